"""A training job as users run it under ``torchrun``: FSDP2 on gloo, refckpt async saves, resume.

Run by ``tests/test_torchrun.py`` (never imported by pytest: torchrun starts it as a script).
Every incarnation (``TORCHELASTIC_RESTART_COUNT``) resumes with ``load_latest``, trains to
``--steps`` and saves every ``--every`` steps asynchronously. What the test judges is written
to ``--out`` by rank 0 only, each file durably (tmp, fsync, rename), so a SIGKILL never leaves a
torn one:

* ``digest_<step>_<incarnation>.json``: a SHA-256 of the *full* (unsharded) model and optimizer state at the
  save of that step, computed with torch's own ``get_state_dict(full_state_dict=True)``, so the
  same digest comes out at any world size;
* ``acked.txt``: one line per acknowledged step (after ``maybe_wait_for_async_save`` returned);
* ``resume_<incarnation>.json``: the step ``load_latest`` landed on, the world size, and the
  digest of the loaded state (at the same point of the job: before any training);
* ``done.json``: the last step and world size, when an incarnation finished;
* ``per_rank_error_<incarnation>.txt`` (``--per-rank-root``): what ``load_latest`` of the
  per-rank-extra-state root gave on start (``loaded PATH``, or the error type and message);
* ``node_local_<rank>.txt`` (``--node-local-root``, written by every rank): what a save into a
  root each node is given its own of (a node-local disk) gave, before the job's own saves
  (``saved``, or the error type and message).

Faults (first incarnation only): ``--kill-rank R --kill-at-step S`` SIGKILLs rank R right after
``save(save_async=True)`` of step S returned, with the background write in flight
(``--kill-agent``: its torchrun agent first, so that its node leaves the job).
``--skew SECONDS`` delays the last rank of a restarted incarnation right before ``init_process_group``
and again right before ``load_latest``, so the ranks arrive at the default group's rendezvous and at
the checkpointer's first collective in a skewed order on purpose.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from refckpt import DistributedCheckpointer, get_training_state, set_training_state

IN, HIDDEN, OUT = 8, 16, 8  # divisible by 1 and 2: FSDP2 shards every dim evenly
BATCH = 4


def build(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train_step(model, opt, step: int) -> None:
    # The same batch on every rank: the result does not depend on the world size's data split.
    g = torch.Generator().manual_seed(7919 * step)
    x = torch.randn(BATCH, IN, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def full_digest(model, opt) -> str | None:
    """SHA-256 of the full model and optimizer state (rank 0; None elsewhere). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()

    def feed(obj, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                feed(obj[k], f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                feed(v, f"{path}[{i}]")
        else:
            h.update(f"{path}={obj!r}".encode())

    feed(msd, "model")
    feed(osd, "optim")
    return h.hexdigest()


def write_durably(path: str, text: str, append: bool = False) -> None:
    if append and os.path.exists(path):
        with open(path) as f:
            text = f.read() + text
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--kill-agent", action="store_true",
                    help="with --kill-rank: SIGKILL the rank's torchrun agent too (its node leaves the job)")
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--extra-state", choices=("per-rank", "embedded"), default="embedded")
    ap.add_argument("--per-rank-root", default=None,
                    help="also save every step into this root with per-rank extra state; on start, load_latest "
                         "from it first and record what it raised in per_rank_error_<incarnation>.txt")
    ap.add_argument("--node-local-root", default=None,
                    help="first save step 1 into this root, which each agent is given its own of, and record the "
                         "outcome in node_local_<rank>.txt; the job then goes on with --root")
    args = ap.parse_args()

    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    skewed = incarnation > 0 and args.skew > 0 and rank == world - 1
    if skewed:
        time.sleep(args.skew)  # a late rank at the default group's rendezvous (see the test's docstring)
    dist.init_process_group("gloo")
    model, opt = build(world)
    ckpt = DistributedCheckpointer(extra_state_per_rank=args.extra_state == "per-rank")
    state = get_training_state(model, opt, {})
    if skewed:
        # The last rank reaches the checkpointer's first collective (where it creates its own
        # process group) late on purpose: an arrival order skewed as a loaded cluster skews it.
        time.sleep(args.skew)
    if args.node_local_root is not None:
        local = DistributedCheckpointer()
        try:
            local.save(args.node_local_root, get_training_state(model, opt, {"global_step": 1}), global_step=1)
            outcome = "saved"
        except Exception as e:  # noqa: BLE001 - the outcome is what the test judges
            outcome = f"{type(e).__name__}: {e}"
        local.close()
        write_durably(os.path.join(args.out, f"node_local_{rank}.txt"), outcome)
    per_rank = None
    if args.per_rank_root is not None:
        per_rank = DistributedCheckpointer(extra_state_per_rank=True)
        try:
            got = per_rank.load_latest(args.per_rank_root, get_training_state(*build(world), {}))
            outcome = f"loaded {got}"
        except Exception as e:  # noqa: BLE001 - the outcome is what the test judges
            outcome = f"{type(e).__name__}: {e}"
        if rank == 0:
            write_durably(os.path.join(args.out, f"per_rank_error_{incarnation}.txt"), outcome)
    path = ckpt.load_latest(args.root, state)
    start = 0
    if path is not None:
        set_training_state(model, opt, state)
        start = int(state["extra_state"]["global_step"])
    digest = full_digest(model, opt)
    if rank == 0:
        write_durably(os.path.join(args.out, f"resume_{incarnation}.json"),
                      json.dumps({"step": start, "path": path, "world_size": world, "digest": digest}))
    pending: int | None = None
    for step in range(start + 1, args.steps + 1):
        train_step(model, opt, step)
        if step % args.every:
            continue
        ckpt.maybe_wait_for_async_save()
        if pending is not None and rank == 0:
            write_durably(os.path.join(args.out, "acked.txt"), f"{pending}\n", append=True)
        digest = full_digest(model, opt)
        if rank == 0:
            write_durably(os.path.join(args.out, f"digest_{step}_{incarnation}.json"), json.dumps({"digest": digest}))
        ckpt.save(args.root, get_training_state(model, opt, {"global_step": step}), global_step=step, save_async=True)
        if per_rank is not None:
            per_rank.save(args.per_rank_root, get_training_state(model, opt, {"global_step": step, "rank": rank}),
                          global_step=step, save_async=True)
        pending = step
        if incarnation == 0 and rank == args.kill_rank and step == args.kill_at_step:
            if args.kill_agent:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.maybe_wait_for_async_save()
    if per_rank is not None:
        per_rank.maybe_wait_for_async_save()
        per_rank.close()
    if rank == 0:
        if pending is not None:
            write_durably(os.path.join(args.out, "acked.txt"), f"{pending}\n", append=True)
        write_durably(os.path.join(args.out, "done.json"), json.dumps({"step": args.steps, "world_size": world}))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
