"""Rank functions for tests/test_fsdp.py: FSDP2 (``fully_shard``) save/load/reshard with refckpt.

Module level, so worlds pickle them by reference. Every function returns plain CPU data
(full, unsharded state as ordinary tensors from rank 0; ``None`` from the other ranks) and
the parent compares it bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refckpt import DistributedCheckpointer, get_training_state, set_training_state

IN, HIDDEN, OUT = 8, 16, 8  # every dim divisible by 1, 2 and 4
UNEVEN = (8, 6, 5)  # dims that do not divide by 2 or 4: FSDP2 pads the last shards
BATCH = 4
SAVE_STEP = 3
TOTAL_STEPS = 5


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def build(seed: int, *, shard: bool = True, dims: tuple[int, int, int] = (IN, HIDDEN, OUT)):
    """The same architecture at any world size; ``seed`` sets the initial weights."""
    torch.manual_seed(seed)
    i, h, o = dims
    model = torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.ReLU(), torch.nn.Linear(h, o))
    if shard:
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True)
    return model, opt


def train(model, opt, steps: range, *, shard: bool = True) -> None:
    """Deterministic data per (step, rank); FSDP2 averages the gradients across ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    in_dim = model[0].in_features
    for step in steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(BATCH, in_dim, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if not shard:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()


def _plain(obj):
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        assert not isinstance(obj, DTensor), "full_state_dict returned a DTensor"
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def full_state(model, opt):
    """Full (unsharded) model and optimizer state as plain CPU tensors on rank 0; None elsewhere.

    Uses torch's own ``get_state_dict(full_state_dict=True)``, independent of refckpt.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return {"model": _plain(msd), "optimizer": _plain(osd)}


def local_shapes(model) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shard shape on this rank (proves the model really is sharded)."""
    from torch.distributed.tensor import DTensor

    return {n: tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
            for n, p in model.named_parameters()}


def save_fsdp(root: str, save_async: bool, *, per_rank: bool = False, dims=(IN, HIDDEN, OUT),
              use_refckpt_state: bool = True) -> dict:
    """Train SAVE_STEP steps sharded at this world size, save, and report the full state.

    With ``save_async`` the model trains one more step while the save persists in the
    background; the checkpoint must hold the state at ``save`` time, which is captured
    (full, rank 0) before that step. ``use_refckpt_state=False`` hands torch's
    ``get_state_dict`` output to ``save`` as it is.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    model, opt = build(0, dims=dims)
    train(model, opt, range(SAVE_STEP))
    full = full_state(model, opt)
    if use_refckpt_state:
        state = get_training_state(model, opt, {"global_step": SAVE_STEP})
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd, "extra_state": {"global_step": SAVE_STEP}}
    dtensor = {
        "model": all(isinstance(v, DTensor) for v in state["model"].values()),
        "moments": all(isinstance(v, DTensor) for st in state["optimizer"]["state"].values()
                       for k, v in st.items() if k != "step"),
    }
    ckpt = DistributedCheckpointer(extra_state_per_rank=per_rank)
    try:
        ckpt.save(root, state, global_step=SAVE_STEP, save_async=save_async)
        if save_async:
            # training goes on while the save persists: the staged copy must not see it
            train(model, opt, range(SAVE_STEP, SAVE_STEP + 1))
            ckpt.maybe_wait_for_async_save()
    finally:
        ckpt.close()
    return {"full": full, "dtensor": dtensor, "local": local_shapes(model)}


def load_full(root: str, *, shard: bool = True, dims=(IN, HIDDEN, OUT), use_refckpt_state: bool = True,
              with_extra: bool = True, expect_error: bool = False) -> dict:
    """Build the same model with another seed at this world size, load the latest step, report the full state.

    With ``expect_error`` a refckpt error is caught here (the world survives) and
    returned as ``{"error": "Type: message"}``.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from refckpt.errors import CheckpointError

    model, opt = build(1234 + dist.get_world_size(), shard=shard, dims=dims)
    ckpt = DistributedCheckpointer()
    extra_in = {} if with_extra else None
    if use_refckpt_state:
        state = get_training_state(model, opt, extra_in)
    else:  # torch's get_state_dict output as it is (torch primes a fresh optimizer itself)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd}
        if with_extra:
            state["extra_state"] = extra_in
    try:
        path = ckpt.load_latest(root, state)
    except CheckpointError as e:
        if not expect_error:
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        ckpt.close()
    if use_refckpt_state:
        extra = set_training_state(model, opt, state)
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        extra = state.get("extra_state")
    return {"path": path, "extra": None if extra is None else dict(extra), "full": full_state(model, opt),
            "local": local_shapes(model)}


def resume_vs_uninterrupted(root: str, save_async: bool) -> dict:
    """3 steps, save, rebuild (other seed), load, 2 steps  vs  5 uninterrupted steps; full states."""
    model, opt = build(0)
    train(model, opt, range(TOTAL_STEPS))
    uninterrupted = full_state(model, opt)
    del model, opt

    model, opt = build(0)
    train(model, opt, range(SAVE_STEP))
    ckpt = DistributedCheckpointer()
    ckpt.save(root, get_training_state(model, opt, {"global_step": SAVE_STEP}), global_step=SAVE_STEP,
              save_async=save_async)
    ckpt.maybe_wait_for_async_save()
    del model, opt

    model, opt = build(99)
    state = get_training_state(model, opt, {})
    path = ckpt.load_latest(root, state)
    extra = set_training_state(model, opt, state)
    train(model, opt, range(extra["global_step"], TOTAL_STEPS))
    resumed = full_state(model, opt)
    ckpt.close()
    return {"path": path, "uninterrupted": uninterrupted, "resumed": resumed}


def plans_agree(root: str) -> dict:
    """On this rank: refckpt's local load plan (``refckpt.planner.local_load_plan``, which skips DCP's
    resharding sweep where the sharding is the saved one) against DCP's own
    ``create_default_local_load_plan``, for the step ``root`` holds (saved by some world) and this
    rank's FSDP2 state: the items must be equal field for field, hint indices included, in order.
    Returns the number of items and how many DTensor shards were planned without the sweep."""
    import os

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.tensor import DTensor

    from refckpt import initialize_optimizer_state
    from refckpt.planner import _same_sharding_item, local_load_plan
    from refckpt.safeload import load_metadata

    model, opt = build(7)
    initialize_optimizer_state(opt)
    flat, _ = flatten_state_dict(get_training_state(model, opt))
    md = load_metadata(os.path.join(root, f"global_step_{SAVE_STEP}", ".metadata"))
    flat = {k: v for k, v in flat.items() if k in md.state_dict_metadata}
    ours, dcps = local_load_plan(flat, md).items, create_default_local_load_plan(flat, md, True).items
    same = [a == b and a.dest_index.index == b.dest_index.index and a.storage_index.index == b.storage_index.index
            for a, b in zip(ours, dcps)]
    direct = sum(_same_sharding_item(k, md.state_dict_metadata[k], v, {}) is not None
                 for k, v in flat.items() if isinstance(v, DTensor))
    return {"items": len(ours), "dcp_items": len(dcps), "all_equal": all(same), "direct": direct}



def plan_reuse(root: str) -> dict:
    """Saves by one checkpointer on this rank of an FSDP2 world of the model's DTensors: the same
    state twice (the second reuses the kept plans), the same shapes in bfloat16 (planned again), the
    same again (reused); then the coordinator alone forgets its plans (as a checkpointer made anew
    there would): that save fails with a CheckpointError on every rank, and the next one plans from
    scratch and succeeds. Returns what each save reused, the error, and whether steps 2 and 6 load
    back bitwise in their own dtypes."""
    import os

    from refckpt import planner as P
    from refckpt.errors import CheckpointError

    seen: list[tuple[bool, bool]] = []
    orig = P.RefSavePlanner.finish_plan

    def finish_plan(self, new_plan):
        out = orig(self, new_plan)
        seen.append((self.reused_global, self.reused_final))
        return out

    P.RefSavePlanner.finish_plan = finish_plan
    try:
        model, opt = build(5)
        train(model, opt, range(2))
        fp32 = {k: v.detach() for k, v in model.state_dict().items()}
        bf16 = {k: v.to(torch.bfloat16) for k, v in fp32.items()}
        ck = DistributedCheckpointer()
        for step, sd in ((1, fp32), (2, fp32), (3, bf16), (4, bf16)):
            ck.save(root, {"model": sd}, global_step=step)
        if dist.get_rank() == 0:
            ck._plan_cache.clear()
            ck._plan_cache.bind((id(ck._group()), 0, dist.get_world_size()))
        error = None
        try:
            ck.save(root, {"model": bf16}, global_step=5)
        except CheckpointError as e:
            error = f"{type(e).__name__}: {e}"
        ck.save(root, {"model": bf16}, global_step=6)
        same = {}
        for step, sd in ((2, fp32), (6, bf16)):
            into = {k: torch.zeros_like(v) for k, v in sd.items()}
            ck.load(os.path.join(root, f"global_step_{step}"), {"model": into})
            same[step] = all(into[k].dtype == v.dtype and torch.equal(into[k].full_tensor(), v.full_tensor())
                             for k, v in sd.items())
        ck.close()
        return {"seen": seen, "error": error, "same": same}
    finally:
        P.RefSavePlanner.finish_plan = orig


def _bitwise(a, b) -> bool:
    """Nested dicts and lists of tensors and plain values: equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    return a == b


def load_exchange(root: str) -> dict:
    """On this rank of an FSDP2 world: save the trained model and optimizer, then load the step into a
    fresh FSDP2 state, counting the object collectives the load makes (DCP's plan exchange gathers
    and scatters every rank's pickled plan; refckpt's load driver exchanges two integers and
    gathers only failures) and the DTensor.to_local() calls that go through autograd (also for a
    non-transactional reader, which reads every item in place inside read_data), then load a
    step whose shard on rank 1 has a flipped byte. Returns the
    counts, whether the loaded state equals the saved one bitwise, and the damaged load's error."""
    import os

    from refckpt import initialize_optimizer_state

    model, opt = build(11)
    train(model, opt, range(2))
    saved = full_state(model, opt)
    ck = DistributedCheckpointer()
    ck.save(root, get_training_state(model, opt), global_step=3)
    ck.save(root, get_training_state(model, opt), global_step=4)
    calls = {"gather_object": 0, "scatter_object_list": 0, "all_gather_object": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counted(name):
        def call(*a, **k):
            calls[name] += 1
            return originals[name](*a, **k)
        return call

    from torch.distributed.tensor._api import _ToTorchTensor

    autograd = {"to_local": 0}
    apply = _ToTorchTensor.apply

    def counted_apply(*a, **k):  # DTensor.to_local() under grad mode: an autograd node per call
        autograd["to_local"] += 1
        return apply(*a, **k)

    model2, opt2 = build(12)
    initialize_optimizer_state(opt2)
    for name in calls:
        setattr(dist, name, counted(name))
    _ToTorchTensor.apply = counted_apply  # type: ignore[method-assign]
    try:
        ck.load(os.path.join(root, "global_step_3"), get_training_state(model2, opt2))
    finally:
        for name, f in originals.items():
            setattr(dist, name, f)
        _ToTorchTensor.apply = apply  # type: ignore[method-assign]
    calls.update(autograd)
    loaded = full_state(model2, opt2)
    same = _bitwise(loaded, saved)
    # the reader's other path: not transactional, every item read in place inside read_data
    import torch.distributed.checkpoint as dcp

    from refckpt.planner import RefLoadPlanner
    from refckpt.storage.reader import SafetensorsReader

    model3, opt3 = build(13)
    initialize_optimizer_state(opt3)
    state3 = get_training_state(model3, opt3)
    state3.pop("extra_state", None)
    autograd["to_local"] = 0
    _ToTorchTensor.apply = counted_apply  # type: ignore[method-assign]
    try:
        dcp.load(state3, storage_reader=SafetensorsReader(os.path.join(root, "global_step_3"), transactional=False),
                 planner=RefLoadPlanner())
    finally:
        _ToTorchTensor.apply = apply  # type: ignore[method-assign]
    calls["to_local_in_place"] = autograd["to_local"]
    same = same and _bitwise(full_state(model3, opt3), saved)
    step4 = os.path.join(root, "global_step_4")
    if dist.get_rank() == 1:
        shard = next(os.path.join(step4, n) for n in sorted(os.listdir(step4)) if n.startswith("__1_"))
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    error = None
    model3, opt3 = build(13)
    initialize_optimizer_state(opt3)
    before = full_state(model3, opt3)
    try:
        ck.load(step4, get_training_state(model3, opt3))
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = f"{type(e).__name__}: {e}"
    after = full_state(model3, opt3)
    untouched = _bitwise(after, before)
    ck.close()
    return {"calls": calls, "same": same, "error": error, "untouched": untouched}


def save_plans_agree(root: str) -> dict:
    """On this rank: refckpt's local save plan (``refckpt.planner.local_save_plan``, which computes a
    DTensor's chunk once per mesh, placements and shape) against DCP's own
    ``create_default_local_save_plan`` for the flattened FSDP2 training state; the parameters
    themselves and a twin model's (DTensors that require grad, of shapes seen before); and hand-made
    DTensors (replicated, sharded unevenly down to an empty shard, bfloat16); with grad mode on
    and off: the items must be equal field for field, in order."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from refckpt.planner import local_save_plan

    model, opt = build(7)
    train(model, opt, range(1))
    flat, _ = flatten_state_dict(get_training_state(model, opt))
    mesh = _mesh()
    extra = {
        "rep": distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()]),
        "one_row": distribute_tensor(torch.ones(1, 4), mesh, [Shard(0)]),  # rank 1's shard is empty
        "uneven": distribute_tensor(torch.ones(5, 2), mesh, [Shard(0)]),
        "uneven_b": distribute_tensor(torch.zeros(5, 2), mesh, [Shard(0)]),
        "bf16": distribute_tensor(torch.ones(4, 4, dtype=torch.bfloat16), mesh, [Shard(1)]),
        "bf16_b": distribute_tensor(torch.ones(4, 4, dtype=torch.bfloat16), mesh, [Shard(1)]),
    }
    twin, _ = build(8)  # the same shapes again: its parameters reuse the first model's chunks
    params = {**{f"p.{n}": p for n, p in model.named_parameters()},
              **{f"q.{n}": p for n, p in twin.named_parameters()}}
    out = {}
    for name, sd in (("state", flat), ("params", params), ("extra", extra)):
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                ours = local_save_plan(sd).items
                dcps = create_default_local_save_plan(sd, dist.get_rank() == 0).items
            out[f"{name}/{grad}"] = (len(ours), len(dcps), all(a == b for a, b in zip(ours, dcps)),
                                     sum(bool(i.tensor_data and i.tensor_data.properties.requires_grad) for i in dcps))
    return out


def two_chunks_in_one_shard(root: str) -> dict:
    """On a one-rank world: a legacy ``ShardedTensor`` whose two row blocks are both this rank's, so
    one shard file holds two chunks of one key, saved.
    Returns the shard header's tensor keys and sharding info, the record's (key, offsets) -> byte
    range, and whether the bytes at each block's recorded range are that block's."""
    import json
    import os
    import struct

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    from refckpt.layout import check_step_dir

    def sharded(a: torch.Tensor, b: torch.Tensor):
        return init_from_local_shards([
            Shard(a, ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 4], placement="rank:0/cpu")),
            Shard(b, ShardMetadata(shard_offsets=[2, 0], shard_sizes=[3, 4], placement="rank:0/cpu")),
        ], [5, 4])

    top, bottom = torch.arange(8.0).reshape(2, 4), torch.arange(100.0, 112.0).reshape(3, 4)
    ck = DistributedCheckpointer()
    ck.save(root, {"model": {"w": sharded(top, bottom)}}, global_step=1)
    step = os.path.join(root, "global_step_1")
    md = check_step_dir(step).metadata
    record = {f"{i.fqn}@{list(i.offset)}": (s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()}
    rel = next(r for r, _o, _n in record.values())
    with open(os.path.join(step, rel), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    keys = {k: (v["data_offsets"][0] + 8 + n, v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}
    ck.close()
    # DCP's load of a ShardedTensor takes one local shard only: the bytes are read where the record says
    same = []
    with open(os.path.join(step, rel), "rb") as f:
        for key, want in (("model.w@[0, 0]", top), ("model.w@[2, 0]", bottom)):
            _rel, off, length = record[key]
            f.seek(off)
            same.append(f.read(length) == want.numpy().tobytes())
    return {"keys": keys, "sharding": sharding, "record": record, "same": all(same)}
