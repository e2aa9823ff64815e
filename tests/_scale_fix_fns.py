"""Rank functions for tests/test_scale_fixes.py (module level: worlds pickle them by reference).

Each returns plain data and undoes whatever it patched in its rank process, so the world is reused.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from refckpt import DistributedCheckpointer, find_latest_checkpoint
from refckpt.errors import CheckpointError
from refckpt.safeload import load_record

ROWS_PER_RANK, COLS = 2, 12  # a w2-like tensor: cut along dim 0, its smaller dimension


def _w2_state(world: int, fill: float | None = None) -> dict:
    """A model of one ``(2 * world, 12)`` ``Shard(0)`` DTensor (cut along its smaller dimension, as
    FSDP cuts an MLP's down projection) and one plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(ROWS_PER_RANK * world * COLS, dtype=torch.float32).reshape(-1, COLS)
    if fill is not None:
        full = torch.full_like(full, fill)
    w2 = distribute_tensor(full, mesh, [Shard(0)])
    bias = torch.arange(3.0) if fill is None else torch.full((3,), fill)
    return {"model": {"w2": w2, "bias": bias}}


def save_skips_dcps_validation_and_broadcasts_little(root: str) -> dict:
    """A ``DistributedCheckpointer`` save of a w2-like DTensor with DCP's ``_validate_global_plan``
    made to raise (refckpt must not call it) and ``dcp.save``'s return value captured (the object
    DCP broadcast to every rank); then a load of it into a zeroed state."""
    from torch.distributed.checkpoint import default_planner

    world = dist.get_world_size()
    state = _w2_state(world)
    returned: list = []
    real_save, real_validate = dcp.save, default_planner._validate_global_plan

    def capturing_save(*a, **k):
        md = real_save(*a, **k)
        returned.append(md)
        return md

    def refuse(*a, **k):
        raise AssertionError("DCP's quadratic _validate_global_plan ran")

    dcp.save = capturing_save
    default_planner._validate_global_plan = refuse
    error = None
    try:
        DistributedCheckpointer().save(root, state, global_step=1)
    except CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        dcp.save, default_planner._validate_global_plan = real_save, real_validate
    out: dict = {"error": error}
    if error is not None:
        return out
    md = returned[0]
    out["returned_bytes"] = len(pickle.dumps(md))
    out["returned_tensors"] = len(md.state_dict_metadata)
    path = find_latest_checkpoint(root)
    record, _ = load_record(os.path.join(path, ".metadata"))
    out["record_tensors"] = sorted(record.state_dict_metadata)
    out["record_w2_chunks"] = len(record.state_dict_metadata["model.w2"].chunks)
    fresh = _w2_state(world, fill=0.0)
    DistributedCheckpointer().load(path, fresh)
    want = _w2_state(world)
    out["round_trip"] = bool(torch.equal(fresh["model"]["w2"].to_local(), want["model"]["w2"].to_local())
                             and torch.equal(fresh["model"]["bias"], want["model"]["bias"]))
    return out


def all_ok(fail_ranks: list[int]) -> dict:
    """The agreement's ``failures`` (refckpt.agree) with ranks ``fail_ranks`` failing, and how many
    ``all_gather_object`` calls it made on this rank."""
    ck = DistributedCheckpointer()
    group = ck._group()
    rank = dist.get_rank()
    calls = 0
    real = dist.all_gather_object

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return real(*a, **k)

    dist.all_gather_object = counting
    try:
        err = OSError(f"boom on rank {rank}") if rank in fail_ranks else None
        failures = ck._agreement(group).failures(err, "a test's decision")
    finally:
        dist.all_gather_object = real
    return {"failures": failures, "all_gather_object_calls": calls}


def save_to_per_rank_roots(base: str) -> str | None:
    """Rank 0 saves under ``base/node_0``, every other rank under ``base/node_1``: a root that is
    not one shared directory. Returns the error the save raised on this rank (None: it saved)."""
    root = os.path.join(base, "node_0" if dist.get_rank() == 0 else "node_1")
    try:
        DistributedCheckpointer().save(root, {"model": {"w": torch.ones(4)}}, global_step=1)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None
