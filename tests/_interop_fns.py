"""Rank functions for tests/test_interop.py (module level: worlds pickle them by reference).

``family_save`` writes a checkpoint the way the VeOmni / hyper_parallel (``hyper_models``)
family's DCP checkpointers do, with plain ``torch.distributed.checkpoint`` and ``torch.save``
only -- no refckpt code on the write side:

* ``extra_state/extra_state_rank_R.pt`` by ``torch.save``, written before the shards;
* ``dcp.save({"model": ..., "optimizer": ...}, storage_writer=FileSystemWriter(step_dir))``
  (``.metadata`` + ``__R_0.distcp``), or with ``use_collectives=False``: one ``__R.metadata``
  per rank, each covering that rank's items only;
* the pointer ``latest_checkpoint_iteration.txt`` = ``"N\\n"`` by rank 0 after a barrier, with a
  plain ``open(..., "w")`` (hyper_models' ``_write_latest_pointer``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from refckpt import LATEST_CHECKPOINT_FILE, DistributedCheckpointer, get_training_state, set_training_state
from refckpt.errors import CheckpointError

from . import _ckpt_fns as fns


def family_save(root: str, step: int, per_rank_records: bool) -> dict:
    """Train ``step`` steps and save them as the family does. Per-rank records get per-rank
    weights (a different init on each rank), so a rank that loads another rank's record shows."""
    rank = dist.get_rank()
    model, opt = fns.build(seed=10 + rank if per_rank_records else 0)
    fns.train(model, opt, range(1, step + 1))
    step_dir = os.path.join(root, f"global_step_{step}")
    extra = fns.extra_for(step, rank, per_rank=True)
    os.makedirs(os.path.join(step_dir, "extra_state"), exist_ok=True)
    dist.barrier()
    torch.save(extra, os.path.join(step_dir, "extra_state", f"extra_state_rank_{rank}.pt"))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=FileSystemWriter(step_dir),
             use_collectives=not per_rank_records)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, LATEST_CHECKPOINT_FILE), "w", encoding="utf-8") as f:
            f.write(f"{step}\n")
    dist.barrier()
    return {"digest": fns.digest(model, opt), "extra": fns.extra_digest(extra)}


def resume(root: str) -> dict:
    """Fresh objects (another init) resume with refckpt; returns what was restored, or the error."""
    ckpt = DistributedCheckpointer()
    model, opt = fns.build(seed=99)
    state = get_training_state(model, opt, {})
    latest = ckpt.find_latest_checkpoint(root)
    try:
        path = ckpt.load_latest(root, state)
    except CheckpointError as e:
        return {"latest": latest, "error": f"{type(e).__name__}: {e}"}
    set_training_state(model, opt, state)
    return {"latest": latest, "path": path, "digest": fns.digest(model, opt),
            "extra": fns.extra_digest(state["extra_state"])}


def refckpt_save_sharded(root: str) -> None:
    """refckpt saves a state holding a row-sharded DTensor, a replicated tensor and a
    non-tensor item: several shard files, chunks with offsets, a ``__bytes__/`` entry."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    table = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    state = {
        "model": {"table": distribute_tensor(table, mesh, [Shard(0)]), "bias": torch.arange(3, dtype=torch.int64)},
        "optimizer": {"param_groups": [{"lr": 0.5, "params": ["table"]}]},
        "extra_state": {"global_step": 5},
    }
    DistributedCheckpointer().save(root, state, global_step=5)
