"""The device smoke test (``.ci/device-smoke``): refckpt on one real GPU or NPU, in a few minutes.

``python -m faults.smoke [--backend nccl|hccl|auto|gloo] [--require]`` runs, in a 1-rank
:class:`~faults.world.World` of the chosen backend with its tensors on ``cuda:0`` / ``npu:0``:

* ``world``: the process group is up and an ``all_reduce`` of a device tensor works;
* ``sync-save``, ``async-save`` (``snapshot="copy"``), ``deferred-save``
  (``snapshot="deferred"``, where this refckpt has it): train a small model, save, keep training
  (async), load into a fresh model and optimizer, and compare parameters and optimizer moments
  *bitwise, on the device*, with their values at the ``save`` call;
* ``pinned-staging``: after the async save, the checkpointer's stager holds one host buffer per
  saved tensor, and exactly the device tensors' buffers are pinned (``tensor.is_pinned()``);
* ``fsdp2``: the same with ``fully_shard`` on a 1-rank device mesh (DTensor state);
* ``bench-save`` / ``bench-load``: a 256 MiB state, device to disk (a sync save, fsync included)
  and disk to device, in GB/s.

It prints exactly one line per check, ``PASS|FAIL|SKIP <check>: <detail>``, then one final line,
and exits 0 unless a check failed -- or, with ``--require``, unless the device checks ran. Where
no device is present every check is a SKIP naming the probe that found none
(``torch.cuda.device_count() == 0``, ``import torch_npu``). ``--backend gloo`` is a dry run of the
same checks on CPU: it proves the script, not a device, and never satisfies ``--require``.

Each check runs as one request to the world; a rank that dies or hangs (``RUN_TIMEOUT_S``) fails
that request's checks and a fresh world serves the next; ``--budget`` bounds the whole run. The
choice of backend, the verdict and the pinned-staging judgement are plain functions of the probes'
results (:func:`choose_backend`, :func:`verdict`, :func:`judge_staging`), so they are tested
without hardware (``tests/test_device_smoke.py``). torch is imported inside functions only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from .backends import GLOO, HCCL, NCCL, BackendChoice, as_choice

__all__ = ["CHECKS", "REQUIRED", "Probe", "Result", "Run", "probe_devices", "choose_backend", "skip_all",
           "verdict", "staging_counts", "judge_staging", "check_runs", "run_checks", "main"]

#: Every check, in the order it runs and prints.
CHECKS = ("world", "sync-save", "async-save", "pinned-staging", "deferred-save", "fsdp2", "bench-save",
          "bench-load")
#: The checks that only a missing device may skip: under ``--require`` each must run (``deferred-save``
#: may skip where the checkpointer has no deferred snapshots).
REQUIRED = tuple(c for c in CHECKS if c != "deferred-save")
STATUSES = ("PASS", "FAIL", "SKIP")

DEFAULT_BENCH_MIB = 256
DEFAULT_BUDGET_S = 270.0  # the whole run; a GPU/NPU job allots it 5 minutes
RUN_TIMEOUT_S = 120.0  # one rank function (a hung collective or copy fails its check, not the job)


# ---------------------------------------------------------------------------------------
# What the machine has, and what to run: plain functions of the probes' results
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the hardware probes found. ``npu_*`` is None where torch_npu was not probed (CUDA
    sufficed)."""

    cuda_count: int
    """``torch.cuda.device_count()``."""
    nccl_available: bool
    """``torch.distributed.is_nccl_available()``."""
    cuda_build: str | None = None
    """``torch.version.cuda`` (None: a CPU or non-CUDA build of torch)."""
    npu_imported: bool | None = None
    """``import torch_npu`` succeeded."""
    npu_count: int | None = None
    """``torch.npu.device_count()`` (0 where torch_npu did not import)."""
    npu_error: str = ""
    """Why ``import torch_npu`` (or its device count) failed."""


def probe_devices(requested: str) -> Probe:
    """Run the real probes: CUDA always (cheap), torch_npu only where it may be chosen."""
    import torch
    import torch.distributed as dist

    from .backends import _npu_probe

    nccl = bool(dist.is_available() and dist.is_nccl_available())
    probe = Probe(cuda_count=int(torch.cuda.device_count()), nccl_available=nccl,
                  cuda_build=getattr(torch.version, "cuda", None))
    if requested == "hccl" or (requested == "auto" and not (probe.cuda_count and nccl)):
        imported, count, why = _npu_probe()
        probe = dataclasses.replace(probe, npu_imported=imported, npu_count=count, npu_error=why)
    return probe


def _cuda_missing(p: Probe) -> str | None:
    if p.cuda_count < 1:
        return "no CUDA device (torch.cuda.device_count() == 0)"
    if not p.nccl_available:
        return f"{p.cuda_count} CUDA device(s) but no NCCL (torch.distributed.is_nccl_available() is False)"
    return None


def _npu_missing(p: Probe) -> str | None:
    if not p.npu_imported:
        return f"no torch_npu (import torch_npu: {p.npu_error or 'not probed'})"
    if not p.npu_count:
        why = f": {p.npu_error}" if p.npu_error else ""
        return f"torch_npu sees no NPU (torch.npu.device_count() == 0{why})"
    return None


def choose_backend(requested: str, probe: Probe) -> tuple[BackendChoice | None, str]:
    """The backend to smoke-test and, where there is none, why (the SKIP reason).

    ``nccl`` needs a CUDA device and NCCL; ``hccl`` needs torch_npu and an NPU; ``auto`` takes
    nccl, else hccl (the order of :func:`faults.backends.select_backend`); ``gloo`` is the CPU dry
    run and always available.
    """
    if requested == "gloo":
        return GLOO, ""
    if requested not in ("nccl", "hccl", "auto"):
        raise ValueError(f"unknown backend {requested!r}; choose nccl, hccl, auto or gloo")
    reasons, notes = [], []
    if requested in ("nccl", "auto"):
        missing = _cuda_missing(probe)
        if missing is None:
            return NCCL, ""
        reasons.append(missing)
        if not probe.cuda_build:
            notes.append("this torch is not a CUDA build (torch.version.cuda is None)")
    if requested in ("hccl", "auto"):
        missing = _npu_missing(probe)
        if missing is None:
            return HCCL, ""
        reasons.append(missing)
    return None, "; ".join([" and ".join(reasons), *notes])


@dataclasses.dataclass(frozen=True)
class Result:
    """One check's outcome: its summary line."""

    check: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def line(self) -> str:
        detail = " ".join(self.detail.split())  # one line, whatever the detail held
        return f"{self.status} {self.check}: {detail}"


def skip_all(reason: str, checks: tuple[str, ...] = CHECKS) -> list[Result]:
    return [Result(c, "SKIP", reason) for c in checks]


def verdict(results: list[Result], *, require: bool, on_device: bool) -> tuple[str, int]:
    """The final line and the exit code: 1 if a check failed; with ``require``, also 1 unless the
    checks ran on a device and every check of :data:`REQUIRED` ran (did not skip)."""
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    tally = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    seen = {r.check for r in results}
    if counts["FAIL"]:
        failed = ", ".join(r.check for r in results if r.status == "FAIL")
        return f"device-smoke FAILED: {tally} (failed: {failed})", 1
    if require:
        if not on_device:
            return f"device-smoke FAILED: --require, but no device check ran: {tally}", 1
        missing = [c for c in REQUIRED if c not in seen]
        skipped = [r.check for r in results if r.status == "SKIP" and r.check in REQUIRED]
        if missing or skipped:
            return f"device-smoke FAILED: --require, but {', '.join(missing + skipped)} did not run: {tally}", 1
    hint = "" if on_device or require else " (no device checked; --require makes this a failure)"
    return f"device-smoke OK: {tally}{hint}", 0


# ---------------------------------------------------------------------------------------
# Rank side: each function runs in the 1-rank world and returns [(check, status, detail)]
# ---------------------------------------------------------------------------------------

IN, HIDDEN, OUT, BATCH = 64, 256, 64, 16
Outcome = list[tuple[str, str, str]]


class _Failed(AssertionError):
    """A check's own verdict: FAIL with this message."""


def _guarded(checks: tuple[str, ...], fn: Callable[[], Outcome]) -> Outcome:
    """``fn()``; an exception fails every check it was to report, naming where it was raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported as the checks' FAIL lines
        where = ""
        frames = traceback.extract_tb(e.__traceback__)
        if frames and not isinstance(e, _Failed):
            f = frames[-1]
            where = f" (at {os.path.basename(f.filename)}:{f.lineno})"
        msg = str(e) if isinstance(e, _Failed) else f"{type(e).__name__}: {e}"
        return [(c, "FAIL", msg[:600] + where) for c in checks]


def _device(backend: str):
    import torch.distributed as dist

    from .backends import device_for_rank

    return device_for_rank(as_choice(backend), dist.get_rank())


def _sync(device) -> None:
    import torch

    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


def _build(seed: int, device, *, fsdp: bool = False):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    model = model.to(device)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def _train(model, opt, steps: range, device) -> None:
    import torch

    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(BATCH, IN, generator=g).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _sync(device)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, tensor) of every tensor in a state tree; a DTensor's local shard."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        yield prefix, tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _tensors(model, opt) -> dict[str, Any]:
    """Parameters and optimizer state as DCP sees them (live aliases, DTensors' local shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return dict(_leaves({"model": msd, "optimizer": osd}))


def _snapshot(model, opt) -> dict[str, Any]:
    """Copies, on the same device, of every tensor a save of (model, opt) holds now."""
    return {k: t.detach().clone() for k, t in _tensors(model, opt).items()}


def _same_bits(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _compare(expected: dict[str, Any], model, opt, device) -> str:
    """Raise :class:`_Failed` unless (model, opt) holds ``expected`` bit for bit, with parameters and
    moments on ``device``; else a short description of what was compared."""
    got = _tensors(model, opt)
    if set(got) != set(expected):
        raise _Failed(f"loaded keys differ from saved: missing {sorted(set(expected) - set(got))[:5]}, "
                      f"extra {sorted(set(got) - set(expected))[:5]}")
    on_device = [k for k in got if k.startswith("model.") or k.endswith((".exp_avg", ".exp_avg_sq"))]
    moments = [k for k in on_device if not k.startswith("model.")]
    if not moments:
        raise _Failed("no optimizer moments (exp_avg, exp_avg_sq) in the state: nothing to compare")
    elsewhere = [f"{k} on {got[k].device}" for k in on_device if got[k].device.type != device.type]
    if elsewhere:
        raise _Failed(f"loaded tensors are not on {device}: {elsewhere[:5]}")
    differ = [k for k in got if not _same_bits(got[k], expected[k])]
    if differ:
        raise _Failed(f"{len(differ)} tensor(s) differ bitwise from their values at the save call: {differ[:5]}")
    n_bytes = sum(t.numel() * t.element_size() for t in got.values())
    return (f"{len(on_device) - len(moments)} params + {len(moments)} moments on {device} (and {len(got) - len(on_device)} "
            f"other) bitwise equal to the save call, {n_bytes / 1024:.0f} KiB")


def _changed(expected: dict[str, Any], model, opt) -> None:
    """Training went on after the save returned: the parameters really differ now (else the check
    would prove nothing about the snapshot)."""
    got = _tensors(model, opt)
    if all(_same_bits(got[k], expected[k]) for k in expected if k.startswith("model.")):
        raise _Failed("the training step after save() changed no parameter: the check would be vacuous")


def _load_fresh(root: str, step: int, device, *, fsdp: bool = False):
    from refckpt import DistributedCheckpointer, get_training_state, set_training_state

    model, opt = _build(4321, device, fsdp=fsdp)
    state = get_training_state(model, opt, {})
    ckpt = DistributedCheckpointer()
    try:
        path = ckpt.load_latest(root, state)
    finally:
        ckpt.close()
    if path is None or os.path.basename(path) != f"global_step_{step}":
        raise _Failed(f"load_latest({root}) found {path}, expected global_step_{step}")
    set_training_state(model, opt, state)
    _sync(device)
    return model, opt


def rank_world(backend: str) -> Outcome:
    """``world``: the device, and an all_reduce of a tensor on it."""

    def run() -> Outcome:
        import torch
        import torch.distributed as dist

        device = _device(backend)
        t = torch.arange(4, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        _sync(device)
        if t.device.type != device.type or t.cpu().tolist() != [0.0, 1.0, 2.0, 3.0]:
            raise _Failed(f"all_reduce on a 1-rank world gave {t.cpu().tolist()} on {t.device}")
        name = ""
        mod = getattr(torch, device.type, None)
        if device.type != "cpu" and mod is not None and hasattr(mod, "get_device_name"):
            name = f" ({mod.get_device_name(device.index or 0)})"
        extra = ""
        if backend == "nccl":
            try:
                extra = f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
            except Exception:  # noqa: BLE001 - version string only
                pass
        elif backend == "hccl":
            try:
                import torch_npu

                extra = f", torch_npu {torch_npu.__version__}"
            except Exception:  # noqa: BLE001 - version string only
                pass
        return [("world", "PASS", f"1-rank {dist.get_backend()} world on {device}{name}, torch {torch.__version__}"
                 f"{extra}: all_reduce on the device ok")]

    return _guarded(("world",), run)


def rank_sync_save(backend: str, root: str) -> Outcome:
    """``sync-save``: save, load into a fresh model, compare with the state at the call."""

    def run() -> Outcome:
        from refckpt import DistributedCheckpointer, get_training_state

        device = _device(backend)
        model, opt = _build(0, device)
        _train(model, opt, range(3), device)
        expected = _snapshot(model, opt)
        ckpt = DistributedCheckpointer()
        try:
            t0 = time.perf_counter()
            ckpt.save(root, get_training_state(model, opt, {"global_step": 3}), global_step=3)
            took = time.perf_counter() - t0
        finally:
            ckpt.close()
        model2, opt2 = _load_fresh(root, 3, device)
        return [("sync-save", "PASS", f"save {took * 1e3:.0f} ms; {_compare(expected, model2, opt2, device)}")]

    return _guarded(("sync-save",), run)


def staging_counts(ckpt, state: dict[str, Any]) -> dict[str, int]:
    """What the checkpointer's stager holds after an async save of ``state`` (the host buffers it
    keeps for the next save: ``refckpt.staging.Stager._bufs``): buffers, pinned buffers and their
    bytes, beside the tensors of ``state`` and how many of them are on an accelerator."""
    bufs = getattr(getattr(ckpt, "_stager", None), "_bufs", None)
    if not isinstance(bufs, dict):
        raise _Failed("the checkpointer has no _stager._bufs (refckpt.staging changed): update faults/smoke.py")
    tensors = [t for _, t in _leaves(state)]
    pinned = [b for b in bufs.values() if b.is_pinned()]
    return {"buffers": len(bufs), "pinned": len(pinned),
            "pinned_bytes": sum(b.numel() * b.element_size() for b in pinned),
            "tensors": len(tensors), "on_device": sum(t.device.type != "cpu" for t in tensors)}


def judge_staging(counts: dict[str, int], device_type: str) -> tuple[str, str]:
    """``pinned-staging``: one buffer per saved tensor, and exactly the device tensors' are pinned."""
    if device_type == "cpu":
        return "SKIP", "CPU tensors (gloo dry run): refckpt pins staging buffers for device tensors only"
    n, on_dev, pinned = counts["buffers"], counts["on_device"], counts["pinned"]
    if not on_dev:
        return "FAIL", f"the saved state has no tensor on {device_type}"
    if n != counts["tensors"] or pinned != on_dev:
        return "FAIL", (f"{pinned} of {n} staging buffers pinned for {on_dev} {device_type} tensors "
                        f"({counts['tensors']} tensors saved)")
    return "PASS", (f"the {pinned} staging buffers of the {on_dev} {device_type} tensors are pinned host memory "
                    f"(tensor.is_pinned(), {counts['pinned_bytes'] / 1024:.0f} KiB); {n - pinned} CPU tensor(s)' "
                    f"buffers unpinned")


def rank_async_save(backend: str, root: str, snapshot: str) -> Outcome:
    """``async-save`` + ``pinned-staging`` (``snapshot="copy"``) or ``deferred-save``: save, train
    one more step at once (forward, backward, optimizer step), wait, load, compare with the state
    at the call."""
    check = "deferred-save" if snapshot == "deferred" else "async-save"
    checks = (check,) if snapshot == "deferred" else (check, "pinned-staging")

    def run() -> Outcome:
        from refckpt import DistributedCheckpointer, get_training_state

        device = _device(backend)
        model, opt = _build(0, device)
        _train(model, opt, range(3), device)
        expected = _snapshot(model, opt)
        ckpt = DistributedCheckpointer()
        try:
            state = get_training_state(model, opt, {"global_step": 3})
            kwargs = {"snapshot": "deferred"} if snapshot == "deferred" else {}
            t0 = time.perf_counter()
            ckpt.save(root, state, global_step=3, save_async=True, **kwargs)
            returned = time.perf_counter() - t0
            _train(model, opt, range(3, 4), device)  # the deferred copy makes opt.step() wait for it
            ckpt.maybe_wait_for_async_save()
            acked = time.perf_counter() - t0
            _changed(expected, model, opt)
            pinned = None if snapshot == "deferred" else judge_staging(staging_counts(ckpt, state), device.type)
        finally:
            ckpt.close()
        model2, opt2 = _load_fresh(root, 3, device)
        detail = (f"save() returned in {returned * 1e3:.1f} ms, acknowledged after {acked * 1e3:.0f} ms with a "
                  f"training step in between; {_compare(expected, model2, opt2, device)}")
        out = [(check, "PASS", detail)]
        if pinned is not None:
            out.append(("pinned-staging", *pinned))
        return out

    return _guarded(checks, run)


def rank_fsdp2(backend: str, root: str) -> Outcome:
    """``fsdp2``: ``fully_shard`` on a 1-rank device mesh; a sync save, then an async save with a
    training step after it; each loaded into a fresh sharded model, compared bitwise."""

    def run() -> Outcome:
        from refckpt import DistributedCheckpointer, get_training_state

        device = _device(backend)
        model, opt = _build(0, device, fsdp=True)
        params = list(model.parameters())
        if not params or not all(_is_dtensor(p) and p.to_local().device.type == device.type for p in params):
            raise _Failed(f"fully_shard did not make the parameters DTensors on {device}")
        _train(model, opt, range(2), device)
        ckpt = DistributedCheckpointer()
        try:
            at2 = _snapshot(model, opt)
            ckpt.save(root, get_training_state(model, opt, {"global_step": 2}), global_step=2)
            _train(model, opt, range(2, 3), device)
            at3 = _snapshot(model, opt)
            ckpt.save(root, get_training_state(model, opt, {"global_step": 3}), global_step=3, save_async=True)
            _train(model, opt, range(3, 4), device)
            ckpt.maybe_wait_for_async_save()
            _changed(at3, model, opt)
        finally:
            ckpt.close()
        model3, opt3 = _load_fresh(root, 3, device, fsdp=True)
        detail3 = _compare(at3, model3, opt3, device)
        shutil.rmtree(os.path.join(root, "global_step_3"))
        model2, opt2 = _load_fresh(root, 2, device, fsdp=True)
        _compare(at2, model2, opt2, device)
        return [("fsdp2", "PASS", f"fully_shard on a 1-rank {device.type} mesh, DTensor state; sync save (step 2) "
                 f"and async save with a step after it (step 3) each loaded bitwise; step 3: {detail3}")]

    return _guarded(("fsdp2",), run)


def rank_bench(backend: str, root: str, mib: int) -> Outcome:
    """``bench-save`` / ``bench-load``: ``mib`` MiB of device tensors, a sync save (device to
    disk, checksums and fsync included) and a load into device tensors (disk to device)."""

    def run() -> Outcome:
        import torch

        from refckpt import DistributedCheckpointer

        device = _device(backend)
        pieces = 4
        numel = max(1, (mib << 20) // 4 // pieces)
        g = torch.Generator().manual_seed(7)
        model = {f"w{i}": torch.randn(numel, generator=g).to(device) for i in range(pieces)}
        n_bytes = pieces * numel * 4
        _sync(device)
        ckpt = DistributedCheckpointer()
        try:
            t0 = time.perf_counter()
            ckpt.save(root, {"model": model}, global_step=1)
            save_s = time.perf_counter() - t0
            target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
            evicted = _evict(os.path.join(root, "global_step_1"))
            _sync(device)
            t0 = time.perf_counter()
            ckpt.load(os.path.join(root, "global_step_1"), target)
            _sync(device)
            load_s = time.perf_counter() - t0
        finally:
            ckpt.close()
        differ = [k for k, v in model.items() if not _same_bits(target["model"][k], v)]
        load = ("FAIL", f"{len(differ)} of {pieces} tensors differ bitwise after the load: {differ}") if differ else (
            "PASS", f"{_rate(n_bytes, load_s)} disk -> {device}, bitwise equal ({evicted})")
        return [("bench-save", "PASS", f"{_rate(n_bytes, save_s)} {device} -> disk ({root}; sync save with "
                 f"checksums and fsync)"), ("bench-load", *load)]

    return _guarded(("bench-save", "bench-load"), run)


def _evict(step_dir: str) -> str:
    """Ask the kernel to drop the step's files from the page cache (they were just written and
    fsynced, so their pages are clean), so that the load reads the disk; says what was done."""
    if not hasattr(os, "posix_fadvise"):
        return "read through the page cache: no posix_fadvise here"
    n = 0
    for dirpath, _dirs, files in os.walk(step_dir):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return f"after posix_fadvise(DONTNEED) on its {n} files"  # a no-op on tmpfs: --dir picks the disk


def _rate(n_bytes: int, seconds: float) -> str:
    return f"{n_bytes / (1 << 20):.0f} MiB in {seconds:.2f} s = {n_bytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


# ---------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------


def deferred_unavailable() -> str | None:
    """Why this refckpt cannot take a deferred snapshot (None: it can)."""
    import inspect

    from refckpt import DistributedCheckpointer

    if "snapshot" not in inspect.signature(DistributedCheckpointer.save).parameters:
        return "this refckpt's DistributedCheckpointer.save has no snapshot= parameter (no deferred snapshots)"
    return None


def _emit(result: Result, out: list[Result]) -> None:
    out.append(result)
    print(result.line(), flush=True)


Run = tuple[tuple[str, ...], Callable[..., Any], tuple]


def check_runs(backend: str, workdir: str, bench_mib: int) -> list[Run]:
    """What :func:`run_checks` runs: (the checks it reports, rank function, its arguments)."""
    return [
        (("world",), rank_world, (backend,)),
        (("sync-save",), rank_sync_save, (backend, os.path.join(workdir, "sync"))),
        (("async-save", "pinned-staging"), rank_async_save, (backend, os.path.join(workdir, "async"), "copy")),
        (("deferred-save",), rank_async_save, (backend, os.path.join(workdir, "deferred"), "deferred")),
        (("fsdp2",), rank_fsdp2, (backend, os.path.join(workdir, "fsdp2"))),
        (("bench-save", "bench-load"), rank_bench, (backend, os.path.join(workdir, "bench"), bench_mib)),
    ]


def run_checks(choice: BackendChoice, *, workdir: str, bench_mib: int, budget_s: float,
               runs: list[Run] | None = None) -> list[Result]:
    """Every check in a 1-rank world of ``choice``; a rank that crashes or hangs fails the checks of
    that run and a fresh world serves the next ones. ``runs`` replaces :func:`check_runs`."""
    from .world import World

    results: list[Result] = []
    deadline = time.monotonic() + budget_s
    backend = choice.backend
    why_no_deferred = deferred_unavailable()
    if runs is None:
        runs = check_runs(backend, workdir, bench_mib)
    world: World | None = None
    broken = ""  # why no world can be had: the rest is not run
    try:
        for checks, fn, args in runs:
            if checks == ("deferred-save",) and why_no_deferred:
                _emit(Result("deferred-save", "SKIP", why_no_deferred), results)
                continue
            left = deadline - time.monotonic()
            if broken or left < 5:
                why = broken or f"not run: the smoke test's time budget ({budget_s:.0f} s, --budget) is spent"
                for c in checks:
                    _emit(Result(c, "FAIL", why), results)
                continue
            try:
                if world is None or not world.alive:
                    world = World(1, choice, timeout=min(RUN_TIMEOUT_S, left))
                    try:
                        world.start()
                    except Exception as e:
                        broken = f"not run: the 1-rank {backend} world did not start: {_first_line(e)}"
                        raise
                outcome = world.run(fn, *args, timeout=min(RUN_TIMEOUT_S, left))[0]
            except Exception as e:  # noqa: BLE001 - a dead, hung or unstartable world fails these checks
                for c in checks:
                    _emit(Result(c, "FAIL", broken or f"{type(e).__name__}: {_first_line(e)}"), results)
                continue
            reported = {check: (status, detail) for check, status, detail in outcome}
            for c in checks:  # exactly one line per check, whatever the rank function returned
                _emit(Result(c, *reported.get(c, ("FAIL", f"{_name(fn)} reported no result for it"))), results)
    finally:
        if world is not None:
            try:
                world.close()
            except Exception as e:  # noqa: BLE001 - the checks' lines are out; this is a note
                print(f"device-smoke: the world did not close cleanly: {e}", file=sys.stderr, flush=True)
    return results


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:600]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=".ci/device-smoke",
        description="refckpt on one GPU (nccl) or NPU (hccl): sync, async and deferred saves, pinned staging, "
                    "FSDP2, a save/load benchmark. One PASS/FAIL/SKIP line per check, then a verdict.")
    p.add_argument("--backend", choices=("nccl", "hccl", "auto", "gloo"), default="auto",
                   help="nccl (cuda:0), hccl (npu:0), auto (nccl, else hccl; default), or gloo: a dry run "
                        "of the checks on CPU that never satisfies --require")
    p.add_argument("--require", action="store_true",
                   help="exit 1 unless the checks ran on a device (a runner that lost its devices fails)")
    p.add_argument("--bench-mib", type=int, default=DEFAULT_BENCH_MIB, metavar="MIB",
                   help=f"size of the benchmark state (default {DEFAULT_BENCH_MIB})")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temporary directory, "
                                               "removed at the end)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help=f"time for all checks (default {DEFAULT_BUDGET_S:.0f})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.bench_mib < 1:
        _parser().error("--bench-mib must be >= 1")
    t0 = time.monotonic()
    choice, reason = choose_backend(args.backend, probe_devices(args.backend))
    if choice is None:
        results = skip_all(reason)
        for r in results:
            print(r.line(), flush=True)
        final, code = verdict(results, require=args.require, on_device=False)
        print(final, flush=True)
        return code
    workdir = tempfile.mkdtemp(prefix="refckpt-device-smoke-", dir=args.dir)
    try:
        results = run_checks(choice, workdir=workdir, bench_mib=args.bench_mib, budget_s=args.budget)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    final, code = verdict(results, require=args.require, on_device=choice.device_type != "cpu")
    where = "cpu" if choice.device_type == "cpu" else f"{choice.device_type}:0"
    print(f"{final} [{choice.backend} on {where}, {time.monotonic() - t0:.1f} s]", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
