"""A runnable example: train a small model on N gloo ranks with periodic checkpoints,
stop, start fresh processes, resume from the newest complete checkpoint and show
what was restored -- bitwise.

    python -m refckpt example [--dir DIR] [--world-size 2] [--steps 10] [--every 4]
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..storage import tensor_to_bytes as _b

__all__ = ["run_example", "state_digest"]


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train_step(model, opt, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.parameters():  # data parallel by hand: average gradients over ranks
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    return float(loss)


def state_digest(model, opt) -> dict[str, str]:
    """sha256 of the parameters and of every optimizer moment, for bitwise comparison."""
    h_params, h_moments = hashlib.sha256(), hashlib.sha256()
    for p in model.parameters():
        h_params.update(_b(p))
        st = opt.state.get(p, {})
        for k in sorted(st):
            h_moments.update(k.encode() + _b(st[k]))
    return {"params": h_params.hexdigest()[:16], "moments": h_moments.hexdigest()[:16]}


def _rank_main(rank: int, world: int, store_dir: str, root: str, phase: str, steps: int, every: int, out: str) -> None:
    from refckpt import DistributedCheckpointer, get_training_state, set_training_state

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store-{phase}", rank=rank, world_size=world)
    model, opt = _build()
    ckpt = DistributedCheckpointer(extra_state_per_rank=True, keep_last=2)
    report: dict[str, Any] = {}
    try:
        if phase == "train":
            for step in range(1, steps + 1):
                _train_step(model, opt, step, rank)
                if step % every == 0:
                    extra = {"global_step": step, "rng": torch.get_rng_state(), "rank": rank}
                    ckpt.save(root, get_training_state(model, opt, extra), global_step=step, save_async=step % (2 * every) == 0)
                    ckpt.maybe_wait_for_async_save()
                    report[str(step)] = state_digest(model, opt)
            # The run "dies" here: steps after the last checkpoint are lost.
        else:
            state = get_training_state(model, opt, {})
            path = ckpt.load_latest(root, state)
            set_training_state(model, opt, state)
            report = {"path": path, "extra_state": {k: v for k, v in state["extra_state"].items() if k != "rng"},
                      "digest": state_digest(model, opt),
                      "exp_avg_norm": float(sum(s["exp_avg"].norm() for s in opt.state.values()))}
        with open(f"{out}.{phase}.{rank}.json", "w") as f:
            json.dump(report, f)
        ckpt.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_example(root: str | None = None, world_size: int = 2, steps: int = 10, every: int = 4,
                start_method: str = "spawn") -> int:
    """Train, 'crash', resume in fresh processes; print what was restored. Returns 0 when bitwise equal.

    ``start_method="forkserver"`` forks the ranks from a server that imported torch once
    (faster when the example runs repeatedly, as in the tests)."""
    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
    work = tempfile.mkdtemp(prefix="refckpt-example-")
    root = root or os.path.join(work, "checkpoints")
    out = os.path.join(work, "report")
    print(f"[1/2] training {steps} steps on {world_size} gloo ranks, checkpoint every {every} -> {root}")
    mp.start_processes(_rank_main, args=(world_size, work, root, "train", steps, every, out), nprocs=world_size,
                       start_method=start_method)
    saved = [json.load(open(f"{out}.train.{r}.json")) for r in range(world_size)]
    print(f"      steps on disk: {sorted(n for n in os.listdir(root) if n.startswith('global_step_'))}; "
          f"pointer says {open(os.path.join(root, 'latest_checkpoint_iteration.txt')).read().strip()}")
    print("[2/2] fresh processes resume from the newest complete checkpoint")
    mp.start_processes(_rank_main, args=(world_size, work, root, "resume", steps, every, out), nprocs=world_size,
                       start_method=start_method)
    ok = True
    for r in range(world_size):
        got = json.load(open(f"{out}.resume.{r}.json"))
        step = got["extra_state"]["global_step"]
        want = saved[r][str(step)]
        same = got["digest"] == want
        ok &= same
        print(f"      rank {r}: loaded {os.path.basename(got['path'])}, extra_state={got['extra_state']}, "
              f"|exp_avg|={got['exp_avg_norm']:.6f}, params+moments bitwise equal to step {step}: {same}")
    print("OK: resumed state is bitwise what was saved" if ok else "FAIL: restored state differs")
    return 0 if ok else 1
