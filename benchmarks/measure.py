"""The rank side: one function per measurement, and :func:`rank_main`, the driver a world runs.

Every function below measures one thing on every rank of the world and appends one record per
repeat to ``rig.runs[key]``: ``{"s": seconds on this rank, "peak": peak extra RSS bytes, ...}``.
Each timed operation runs between barriers, after an untimed settle (:meth:`Ctx.settle`: a full
garbage collection, ``os.sync()`` and a wait for ``Dirty + Writeback`` to drain, so that no
operation pays for what earlier ones left behind; ``python -m benchmarks --probe-swing`` measures
why), into a fresh directory deleted once measured; reads come after the page cache of the files
to read is dropped. Each record also says where the rank's main thread spent the time (on a CPU,
waiting for one, blocked) and how long the garbage collector ran.
Within each repeat the measurements run in turn (raw, torch.save, DCP, refckpt, ...), and the
order is rotated by one from repeat to repeat, so that no measurement always runs first, or
always right after the same one: slow phases of a shared disk land on all of them alike.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import ops
from .probes import PeakRSS, SchedClock, drop_cache, du, settle_dirty
from .state import batch, build_state, loss, profile, tensor_only, tensors

__all__ = ["MEASUREMENTS", "WS1_ONLY", "FIRST_ONLY", "TRAIN_VARIANTS", "MEASURE_ORDER", "has_deferred", "rank_main"]

MiB = 1 << 20

#: Every measurement of one world size and mix: key -> description.
MEASUREMENTS: dict[str, str] = {
    "memcpy": "memory copy of the state (clone every tensor)",
    "raw_write": "raw sequential write + fsync (file + dir), one file per rank",
    "raw_read": "raw read into a preallocated buffer, page cache dropped",
    "raw_read_ckpt": "raw read of this rank's refckpt shard (the file refckpt_load reads next), page cache dropped",
    "torch_save": "torch.save + fsync (each rank its share: the state at world size 1, its local tensors above)",
    "torch_load": "torch.load(weights_only=True) of that file, page cache dropped",
    "safetensors_save": "safetensors.torch.save_file + fsync of the rank's tensors (each rank its share)",
    "safetensors_load": ("safetensors.torch.load_file of that file, then every tensor copied into the state (the bytes "
                         "in the training state's memory, as a resume needs them), page cache dropped"),
    "safetensors_load_lazy": ("safetensors.torch.load_file alone, page cache dropped: it maps the file and reads no byte "
                              "(the tensors read the disk when first touched)"),
    "dcp_save": "plain DCP save (FileSystemWriter)",
    "dcp_load": "plain DCP load (FileSystemReader)",
    "dcp_st_save": "DCP safetensors save (HuggingFaceStorageWriter, tensors only)",
    "dcp_st_load": "DCP safetensors load (HuggingFaceStorageReader, tensors only)",
    "refckpt_save": ("refckpt save (sync), on a long-lived checkpointer: its save plans kept from an earlier save, as a "
                     "training loop's later saves"),
    "refckpt_save_first": "refckpt save (sync): a checkpointer's first save (its plans made; once per run)",
    "refckpt_load": "refckpt load",
    "refckpt_load_onepass": ("refckpt's reader in one pass (DCP load with SafetensorsReader: reads straight into the state, "
                             "checksums compared at the end; no transaction)"),
    "refckpt_async_blocked_first": "refckpt async save (copy): caller blocked, first save (staging buffers allocated; once)",
    "refckpt_async_durable_first": "refckpt async save (copy): until durable, first save (once)",
    "refckpt_async_blocked": "refckpt async save (copy): caller blocked, steady state (later saves reuse the buffers)",
    "refckpt_async_durable": "refckpt async save (copy): until durable, steady state",
    "refckpt_deferred_blocked_first": "refckpt deferred async save: caller blocked, first save (once)",
    "refckpt_deferred_durable_first": "refckpt deferred async save: until durable, first save (once)",
    "refckpt_deferred_blocked": "refckpt deferred async save: caller blocked, steady state",
    "refckpt_deferred_durable": "refckpt deferred async save: until durable, steady state",
    "refckpt_save_nochecksum": "refckpt save, checksums=False",
    "refckpt_load_nochecksum": "refckpt load, verify_checksums=False",
    "train_none": "training run, no save: seconds per step",
    "train_sync": "training run, a sync save every k steps: seconds per step",
    "train_async": "training run, an async save (copy) every k steps: seconds per step",
    "train_deferred": "training run, a deferred async save every k steps: seconds per step",
}
#: Measured at world size 1 only (none now: the formats' baselines are each rank's share at any size).
WS1_ONLY: tuple[str, ...] = ()
#: One sample per run (the long-lived checkpointer's first save), not one per repeat.
FIRST_ONLY = ("refckpt_save_first", "refckpt_async_blocked_first", "refckpt_async_durable_first",
              "refckpt_deferred_blocked_first", "refckpt_deferred_durable_first")
#: The training runs: measurement key -> how the run saves (None: it does not).
TRAIN_VARIANTS: dict[str, str | None] = {"train_none": None, "train_sync": "sync", "train_async": "copy",
                                         "train_deferred": "deferred"}
#: What the report says where the deferred snapshot cannot be measured.
NO_DEFERRED = "n/a (this refckpt has no deferred snapshot)"
#: What it says at a world size that does not run the training runs.
NO_TRAIN = "n/a (no training runs at this world size)"


def has_deferred() -> bool:
    """Whether this refckpt's ``save`` takes ``snapshot=`` (the deferred, zero-stall async snapshot)."""
    from refckpt import DistributedCheckpointer

    return "snapshot" in inspect.signature(DistributedCheckpointer.save).parameters


class Ctx:
    """Per-rank context of one world: timing between barriers, fresh directories, cache drops."""

    def __init__(self, cfg: dict) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.ws = dist.get_world_size()
        self.base = cfg["base"]
        self.drop = cfg["drop_caches"]
        self.drops: list[dict] = []
        t_start = time.monotonic()
        loud = self.rank == 0 and not cfg["quiet"]
        self.say: Callable[[str], None] = (
            (lambda msg: print(f"[bench ws={self.ws} {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True))
            if loud else (lambda msg: None))

    def du(self, shared_dir: str) -> int:
        """Bytes on disk under a directory all ranks wrote into (counted once, by rank 0)."""
        return du(shared_dir) if self.rank == 0 else 0

    def barrier(self) -> None:
        if self.ws > 1:
            self.dist.barrier()

    def fresh(self, name: str) -> str:
        path = os.path.join(self.base, name)
        if self.rank == 0:
            os.makedirs(path)
        self.barrier()
        return path

    def remove(self, path: str) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    def drop_for_read(self, path: str, all_ranks_files: bool = True) -> None:
        """Drop the cache of ``path`` (rank 0 for shared dirs, or each rank its own file) before a read."""
        self.barrier()
        if not all_ranks_files or self.rank == 0:
            used, total, resident = drop_cache(path, self.drop)
            self.drops.append({"path": os.path.relpath(path, self.base), "method": used, "bytes": total, "resident": resident})
        self.barrier()

    def settle(self) -> dict:
        """Before a timed operation (untimed): a full garbage collection (a save that allocates must not
        pay for the collector's backlog of earlier work: one full collection of this process's objects
        took 0.19-0.28 s, the length of a whole 256 MiB save), ``os.sync()`` and a wait (at most 2 s)
        for the system's Dirty + Writeback to drain below 1 MiB; then every rank ready. Returns what
        the drain saw (``dirty_kib`` / ``writeback_kib`` left when the operation starts)."""
        gc.collect()
        seen = settle_dirty()
        self.barrier()
        return {k: seen[k] for k in ("dirty_kib", "writeback_kib")}

    def timed(self, fn, *args) -> dict:
        """Run ``fn`` between barriers after :meth:`settle`; wall time and peak extra RSS on this rank,
        where the main thread's time went (:class:`benchmarks.probes.SchedClock`) and the system's
        dirty pages when it started."""
        seen = self.settle()
        mem = PeakRSS().start()
        clock = SchedClock()
        fn(*args)
        dt = time.perf_counter() - clock.t0
        sched = clock.stop()
        peak = mem.stop()
        self.barrier()
        return {"s": dt, "peak": peak} | sched | seen


def dcp_st_classes() -> tuple[Any, Any] | str:
    """DCP's safetensors writer and reader classes, or why they are not available."""
    try:
        import safetensors  # noqa: F401
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return HuggingFaceStorageWriter, HuggingFaceStorageReader


@dataclass
class Rig:
    """One mix's state on this rank and what the measurements share."""

    ctx: Ctx
    mix: str
    cfg: dict
    state: Any
    named: list
    flat: Any  # the state's tensor bytes back to back: the raw writer's buffer
    tensor_state: Any
    info: dict
    runs: dict[str, list[dict]] = field(default_factory=lambda: {k: [] for k in MEASUREMENTS})
    dcp_st: Any = None
    async_ckpt: Any = None  # long-lived checkpointers: default copy mode, deferred snapshot
    deferred_ckpt: Any = None
    sync_ckpts: dict = field(default_factory=dict)  # long-lived sync checkpointers, by measurement suffix
    keep: Any = None  # the model and optimizer the state's tensors belong to (the training loop trains them)
    dims: Any = None
    x: Any = None  # the training loop's batch
    read_buf: Any = None  # raw_read_ckpt's buffer, allocated and touched once

    @classmethod
    def build(cls, ctx: Ctx, cfg: dict, mix: str) -> Rig:
        import torch

        ctx.say(f"{mix}: building a {cfg['size_bytes'] / MiB:.0f} MiB state")
        model, opt, state, dims = build_state(cfg["size_bytes"], mix)
        named = list(tensors(state))
        sizes = [t.numel() * t.element_size() for _n, t in named]
        info: dict[str, Any] = profile(sizes) | {"dims": dims, "orders": []}
        flat = torch.empty(info["payload_bytes"], dtype=torch.uint8)
        pos = 0
        for (_n, t), n in zip(named, sizes):
            flat[pos:pos + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            pos += n
        st = dcp_st_classes()
        if isinstance(st, str):
            info["dcp_st_unavailable"] = st
        rig = cls(ctx=ctx, mix=mix, cfg=cfg, state=state, named=named, flat=flat, tensor_state=tensor_only(state),
                  info=info, dcp_st=None if isinstance(st, str) else st, keep=(model, opt), dims=dims, x=batch(dims),
                  read_buf=torch.zeros(ops.CHUNK, dtype=torch.uint8))
        for _ in range(2):  # first steps allocate the gradients
            rig.step()
        # Everything alive now lives as long as the run: out of the collector's way (as training
        # frameworks do), so that the full collection before every timed operation is cheap.
        gc.collect()
        gc.freeze()
        return rig

    def step(self) -> None:
        """One training step of the state's own model and optimizer (FSDP2 at world size > 1)."""
        model, opt = self.keep
        out = loss(model, self.dims, self.x)
        opt.zero_grad(set_to_none=True)
        out.backward()
        opt.step()

    def fresh(self, what: str, rep: int) -> str:
        return self.ctx.fresh(f"{self.mix}-{what}-{rep}")


# ---------------------------------------------------------------------------------------------
# One function per measurement
# ---------------------------------------------------------------------------------------------


def measure_memcpy(rig: Rig, rep: int) -> None:
    """``memcpy``: clone every tensor (what staging an async save must cost at least)."""
    held: list = []
    rig.runs["memcpy"].append(rig.ctx.timed(lambda: held.extend(t.clone() for _n, t in rig.named)))
    held.clear()


def measure_raw(rig: Rig, rep: int) -> None:
    """``raw_write`` / ``raw_read``: the state's bytes to one file per rank and back, the ceiling."""
    ctx = rig.ctx
    d = rig.fresh("raw", rep)
    fp = os.path.join(d, f"rank{ctx.rank}.bin")
    rig.runs["raw_write"].append(ctx.timed(ops.raw_write, fp, rig.flat) | {"disk": du(fp)})
    ctx.drop_for_read(fp, all_ranks_files=False)
    rig.runs["raw_read"].append(ctx.timed(ops.raw_read, fp, rig.flat))
    ctx.remove(d)


def measure_torch_save(rig: Rig, rep: int) -> None:
    """``torch_save`` / ``torch_load``: ``torch.save`` + fsync, then ``torch.load(weights_only=True)``
    with the page cache dropped. At world size 1 the state itself; above, each rank saves its share
    (its local tensors, by name) to a file of its own."""
    import torch

    ctx = rig.ctx
    what = rig.state if ctx.ws == 1 else {n: t for n, t in rig.named}
    d = rig.fresh("torch-save", rep)
    fp = os.path.join(d, f"state_rank{ctx.rank}.pt")
    rig.runs["torch_save"].append(ctx.timed(ops.torch_save, fp, what) | {"disk": du(d)})
    ctx.drop_for_read(fp, all_ranks_files=False)
    held: list = []
    rig.runs["torch_load"].append(ctx.timed(lambda: held.append(torch.load(fp, map_location="cpu", weights_only=True))))
    held.clear()
    ctx.remove(d)


def measure_safetensors(rig: Rig, rep: int) -> None:
    """``safetensors_save`` / ``safetensors_load``: ``safetensors.torch.save_file`` of the rank's
    tensors + fsync, then ``load_file`` with the page cache dropped (each rank its share).

    ``load_file`` (safetensors 0.8, its default ``mmap`` backend) maps the file copy-on-write and
    returns tensors backed by the mapping: it reads nothing (an strace shows ``mmap`` and
    ``fadvise(SEQUENTIAL)`` only), and the disk is read when the tensors are first touched. Timed
    alone (``safetensors_load_lazy``) it is the cost of a map, not of a load. ``safetensors_load``
    is the completed load: ``load_file``, then every tensor copied into the state's own tensors
    (what ``model.load_state_dict(load_file(path))`` costs on resume), the bytes in the caller's
    memory as refckpt's load leaves them."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    ctx = rig.ctx
    st_dict = {n: t.contiguous() for n, t in rig.named}
    d = rig.fresh("safetensors", rep)
    fp = os.path.join(d, f"model_rank{ctx.rank}.safetensors")
    rig.runs["safetensors_save"].append(ctx.timed(ops.st_save, fp, st_dict) | {"disk": du(d)})
    del st_dict
    ctx.drop_for_read(fp, all_ranks_files=False)
    held: list = []
    rig.runs["safetensors_load_lazy"].append(ctx.timed(lambda: held.append(load_file(fp))))
    held.clear()
    ctx.drop_for_read(fp, all_ranks_files=False)
    rig.runs["safetensors_load"].append(ctx.timed(_st_load_into, fp, rig.named))
    ctx.remove(d)


def _st_load_into(path: str, named: list) -> None:
    """``load_file(path)``, then each tensor copied into the state's tensor of that name."""
    import torch
    from safetensors.torch import load_file

    loaded = load_file(path)
    with torch.no_grad():
        for name, t in named:
            t.copy_(loaded[name])


def measure_dcp(rig: Rig, rep: int) -> None:
    """``dcp_save`` / ``dcp_load``: plain DCP with the default ``FileSystemWriter`` / ``FileSystemReader``."""
    import torch.distributed.checkpoint as dcp

    ctx = rig.ctx
    d = rig.fresh("dcp", rep)
    r = ctx.timed(lambda: dcp.save(rig.state, storage_writer=dcp.FileSystemWriter(d)))
    rig.runs["dcp_save"].append(r | {"disk": ctx.du(d)})
    ctx.drop_for_read(d)
    rig.runs["dcp_load"].append(ctx.timed(lambda: dcp.load(rig.state, storage_reader=dcp.FileSystemReader(d))))
    ctx.remove(d)


def measure_dcp_safetensors(rig: Rig, rep: int) -> None:
    """``dcp_st_save`` / ``dcp_st_load``: DCP's safetensors writer and reader, tensor items only."""
    import torch.distributed.checkpoint as dcp

    if rig.dcp_st is None:
        return
    ctx = rig.ctx
    writer_cls, reader_cls = rig.dcp_st
    d = rig.fresh("dcp-st", rep)
    try:
        r = ctx.timed(lambda: dcp.save(rig.tensor_state, storage_writer=writer_cls(d, save_distributed=ctx.ws > 1)))
        rig.runs["dcp_st_save"].append(r | {"disk": ctx.du(d)})
        ctx.drop_for_read(d)
        rig.runs["dcp_st_load"].append(ctx.timed(lambda: dcp.load(rig.tensor_state, storage_reader=reader_cls(d))))
    except Exception as e:  # noqa: BLE001 - reported as n/a with the reason
        rig.info["dcp_st_unavailable"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        rig.dcp_st = None
        rig.runs["dcp_st_save"].clear()
        rig.runs["dcp_st_load"].clear()
    ctx.remove(d)


def _refckpt_save_load(rig: Rig, rep: int, suffix: str, **kw) -> None:
    from refckpt import DistributedCheckpointer

    ctx = rig.ctx
    ckpt = rig.sync_ckpts.get(suffix)
    if ckpt is None:  # made by first_saves; a measurement run alone makes its own
        ckpt = rig.sync_ckpts[suffix] = DistributedCheckpointer(**kw)
    d = rig.fresh(f"refckpt{suffix}", rep)
    r = ctx.timed(lambda: ckpt.save(d, rig.state, global_step=1))
    step_dir = os.path.join(d, "global_step_1")
    names = sorted(os.listdir(step_dir))
    shards = [os.path.getsize(os.path.join(step_dir, n)) for n in names if n.endswith(".safetensors")]
    rig.runs[f"refckpt_save{suffix}"].append(r | {"disk": ctx.du(d), "largest_shard": max(shards)})
    if not suffix:  # the same bytes from the same blocks: disk placement cancels out
        mine = [os.path.join(step_dir, n) for n in names if n.startswith(f"__{ctx.rank}_")]
        ctx.drop_for_read(d)
        rig.runs["raw_read_ckpt"].append(ctx.timed(ops.raw_read_files, mine, rig.read_buf))
    ctx.drop_for_read(d)
    rig.runs[f"refckpt_load{suffix}"].append(ctx.timed(lambda: ckpt.load(step_dir, rig.state)))
    if not suffix:  # what the transaction costs: the same bytes read once, into the state as they come
        ctx.drop_for_read(d)
        rig.runs["refckpt_load_onepass"].append(ctx.timed(lambda: _one_pass_load(step_dir, rig.state, ckpt)))
    ctx.remove(d)


def _one_pass_load(step_dir: str, state: dict, ckpt) -> None:
    """DCP's load with refckpt's reader and planner, not transactional: every verified byte read once,
    straight into the state (what refckpt's load did before its transaction; the state is not
    restored on failure)."""
    import torch.distributed.checkpoint as dcp

    from refckpt.interop import RankRecordReader
    from refckpt.planner import RefLoadPlanner

    group = ckpt._group()
    rank = 0 if group is None else group.rank()
    view = {k: v for k, v in state.items() if k != "extra_state"}
    dcp.load(view, storage_reader=RankRecordReader(step_dir, rank), planner=RefLoadPlanner(checkpoint_path=step_dir),
             process_group=group, no_dist=group is None)


def measure_refckpt(rig: Rig, rep: int) -> None:
    """``refckpt_save`` / ``raw_read_ckpt`` / ``refckpt_load``: sync save, a raw read of the shards it wrote, load."""
    _refckpt_save_load(rig, rep, "")


def measure_refckpt_nochecksum(rig: Rig, rep: int) -> None:
    """``refckpt_save_nochecksum`` / ``refckpt_load_nochecksum``: the same without checksums."""
    _refckpt_save_load(rig, rep, "_nochecksum", checksums=False, verify_checksums=False)


def _save_kw(mode: str) -> dict:
    """``save`` keywords of an async save in ``mode`` (``copy``: the default; ``deferred``)."""
    return {"save_async": True} | ({"snapshot": "deferred"} if mode == "deferred" else {})


def _async_save(rig: Rig, ckpt, path: str, mode: str) -> dict:
    """One async save on a long-lived checkpointer: blocked s, until durable s, peak extra RSS, and
    where the main thread's time went while it was blocked."""
    ctx = rig.ctx
    seen = ctx.settle()
    mem = PeakRSS().start()
    clock = SchedClock()
    ckpt.save(path, rig.state, global_step=1, **_save_kw(mode))
    blocked = time.perf_counter() - clock.t0
    sched = clock.stop()
    ckpt.maybe_wait_for_async_save()
    durable = time.perf_counter() - clock.t0
    peak = mem.stop()
    ctx.barrier()
    return {"blocked": blocked, "durable": durable, "peak": peak} | sched | seen


def _record_async(rig: Rig, prefix: str, r: dict, disk: int | None) -> None:
    rest = {k: v for k, v in r.items() if k not in ("blocked", "durable")}
    rig.runs[f"{prefix}_blocked"].append(rest | {"s": r["blocked"]})
    rig.runs[f"{prefix}_durable"].append(rest | {"s": r["durable"]} | ({} if disk is None else {"disk": disk}))


def first_saves(rig: Rig) -> None:
    """``refckpt_save_first``: the long-lived sync checkpointer's first save, which makes the save
    plans its later saves keep (once per run; the one without checksums saves once untimed);
    ``refckpt_{async,deferred}_{blocked,durable}_first``: each long-lived checkpointer's first async
    save, which maps the host staging buffers its later saves reuse (once per run; the memory kept
    is ``staging_held_bytes`` in the JSON)."""
    from refckpt import DistributedCheckpointer

    variants: tuple[tuple[str, dict[str, Any]], ...] = (("", {}), ("_nochecksum", {"checksums": False,
                                                                                 "verify_checksums": False}))
    for suffix, kw in variants:
        rig.ctx.say(f"{rig.mix}: first sync save{suffix}")
        ckpt = rig.sync_ckpts[suffix] = DistributedCheckpointer(**kw)
        d = rig.fresh(f"refckpt{suffix}-first", 0)
        r = rig.ctx.timed(functools.partial(ckpt.save, d, rig.state, global_step=1))
        if not suffix:
            rig.runs["refckpt_save_first"].append(r)
        rig.ctx.remove(d)

    modes = [("copy", "refckpt_async")] + ([("deferred", "refckpt_deferred")] if rig.cfg["deferred"] else [])
    for mode, prefix in modes:
        rig.ctx.say(f"{rig.mix}: first async save ({mode})")
        ckpt = DistributedCheckpointer()
        if mode == "copy":
            rig.async_ckpt = ckpt
        else:
            rig.deferred_ckpt = ckpt
        d = rig.fresh(f"{prefix}-first", 0)
        r = _async_save(rig, ckpt, d, mode)
        rest = {k: v for k, v in r.items() if k not in ("blocked", "durable")}
        rig.runs[f"{prefix}_blocked_first"].append(rest | {"s": r["blocked"]})
        rig.runs[f"{prefix}_durable_first"].append(rest | {"s": r["durable"]})
        rig.info[f"staging_held_bytes_{mode}"] = ops.staging_held_bytes(ckpt)
        rig.ctx.remove(d)


def measure_refckpt_async(rig: Rig, rep: int) -> None:
    """``refckpt_async_blocked`` / ``refckpt_async_durable``: ``save(save_async=True)`` on the long-lived
    checkpointer, as a training loop uses it (steady state): time the caller is blocked, time until durable."""
    d = rig.fresh("refckpt-async", rep)
    r = _async_save(rig, rig.async_ckpt, d, "copy")
    _record_async(rig, "refckpt_async", r, rig.ctx.du(d))
    rig.ctx.remove(d)


def measure_refckpt_deferred(rig: Rig, rep: int) -> None:
    """``refckpt_deferred_blocked`` / ``refckpt_deferred_durable``: the same with ``snapshot="deferred"``
    (``save`` returns before copying; the copy runs in the background), steady state."""
    if rig.deferred_ckpt is None:
        return
    d = rig.fresh("refckpt-deferred", rep)
    r = _async_save(rig, rig.deferred_ckpt, d, "deferred")
    _record_async(rig, "refckpt_deferred", r, rig.ctx.du(d))
    rig.ctx.remove(d)


def train_run(rig: Rig, key: str, rep: int) -> None:
    """One training run of ``cfg["train_steps"]`` steps of the state's own model, saving the state after
    every ``cfg["save_every"]``-th step (but the last: the run ends ``save_every`` steps after its last
    save, and waits for that save to be durable, inside the timing); seconds per step."""
    mode = TRAIN_VARIANTS[key]
    if mode == "deferred" and rig.deferred_ckpt is None:
        return
    ctx = rig.ctx
    from refckpt import DistributedCheckpointer

    ckpt = {None: None, "sync": None, "copy": rig.async_ckpt, "deferred": rig.deferred_ckpt}[mode]
    if mode == "sync":
        ckpt = DistributedCheckpointer()
    kw = {} if mode == "sync" else _save_kw(mode or "copy")
    steps, every = rig.cfg["train_steps"], rig.cfg["save_every"]
    d = rig.fresh(f"train-{mode}", rep)
    seen = ctx.settle()
    clock = SchedClock()
    saves = 0
    for i in range(1, steps + 1):
        rig.step()
        if mode is not None and i % every == 0 and i + every <= steps:
            ckpt.save(d, rig.state, global_step=i, **kw)
            saves += 1
    if mode is not None:
        ckpt.maybe_wait_for_async_save()
    dt = time.perf_counter() - clock.t0
    sched = clock.stop()
    ctx.barrier()
    if mode == "sync":
        ckpt.close()
    rig.runs[key].append({"s": dt / steps, "run_s": dt, "steps": steps, "saves": saves, "peak": None} | sched | seen)
    ctx.remove(d)


def measure_train(rig: Rig, rep: int) -> None:
    """``train_none`` / ``train_sync`` / ``train_async`` / ``train_deferred``: the same training run
    without saves and with each kind of save, back to back (their order rotated by the repeat);
    only at the world sizes of ``--train-world-sizes``."""
    if not rig.cfg["train"]:
        return
    keys = list(TRAIN_VARIANTS)
    k = rep % len(keys)
    for key in keys[k:] + keys[:k]:
        train_run(rig, key, rep)


#: The measurements of one repeat, in turn; :func:`rank_main` rotates this order by one per repeat.
MEASURE_ORDER: list[Callable[[Rig, int], None]] = [
    measure_raw, measure_dcp, measure_refckpt, measure_memcpy, measure_torch_save, measure_safetensors,
    measure_dcp_safetensors, measure_refckpt_nochecksum, measure_refckpt_async, measure_refckpt_deferred, measure_train,
]


def order_of(rep: int) -> list[Callable[[Rig, int], None]]:
    k = rep % len(MEASURE_ORDER)
    return MEASURE_ORDER[k:] + MEASURE_ORDER[:k]


def warm_up(ctx: Ctx) -> None:
    """One save and load of a tiny state by every writer: one-time costs (refckpt's checkpoint
    process group, DCP's first-call setup, lazy imports) must not land in the first repeat."""
    import torch
    import torch.distributed.checkpoint as dcp

    from refckpt import DistributedCheckpointer

    ctx.say("warm-up")
    tiny = {"model": {"w": torch.ones(8)}}
    d = ctx.fresh("warmup")
    dcp.save(tiny, storage_writer=dcp.FileSystemWriter(os.path.join(d, "dcp")))
    dcp.load(tiny, storage_reader=dcp.FileSystemReader(os.path.join(d, "dcp")))
    st = dcp_st_classes()
    if not isinstance(st, str):
        try:
            dcp.save(tiny, storage_writer=st[0](os.path.join(d, "dcp-st"), save_distributed=ctx.ws > 1))
            dcp.load(tiny, storage_reader=st[1](os.path.join(d, "dcp-st")))
        except Exception:  # noqa: BLE001 - the measurement reports it
            pass
    ckpt = DistributedCheckpointer()
    ckpt.save(os.path.join(d, "refckpt"), tiny, global_step=1)
    ckpt.load(os.path.join(d, "refckpt", "global_step_1"), tiny)
    ckpt.save(os.path.join(d, "refckpt"), tiny, global_step=2, save_async=True)
    if has_deferred():
        ckpt.save(os.path.join(d, "refckpt"), tiny, global_step=3, save_async=True, snapshot="deferred")
    ckpt.close()
    ctx.remove(d)


def measure_mix(ctx: Ctx, cfg: dict, mix: str) -> dict:
    """Every measurement of one mix, ``cfg["repeats"]`` times, interleaved."""
    rig = Rig.build(ctx, cfg, mix)
    first_saves(rig)
    for rep in range(cfg["repeats"]):
        order = order_of(rep)
        ctx.say(f"{mix}: repeat {rep + 1}/{cfg['repeats']}")
        rig.info["orders"].append([m.__name__.removeprefix("measure_") for m in order])
        for measure in order:
            measure(rig, rep)
    rig.async_ckpt.close()
    if rig.deferred_ckpt is not None:
        rig.deferred_ckpt.close()
    for ckpt in rig.sync_ckpts.values():
        ckpt.close()
    return {"runs": rig.runs, "info": rig.info}


def rank_main(cfg: dict) -> dict:
    """Everything measured at one world size, on one rank: every mix in ``cfg["mixes"]``."""
    ctx = Ctx(cfg)
    warm_up(ctx)
    mixes = {mix: measure_mix(ctx, cfg, mix) for mix in cfg["mixes"]}
    ctx.say("done")
    return {"rank": ctx.rank, "mixes": mixes, "rss_method": PeakRSS.method, "drops": ctx.drops}
