"""A checkpointer shaped like the ones most hand-written trainers use (issue 28's fixture): no commit
record, no pointer, sync only, plain tensors only (no DTensor/FSDP2) -- and it says so
(``capabilities``: the :class:`faults.contract.Limitation` names).

A step directory holds ``model.safetensors`` (the model's tensors, ``safetensors.torch.save_file``),
``optimizer.pt`` (``torch.save`` of the optimizer state dicts and every other part of the state but
the model and the extra state, such as ``fp32_main_params``), ``rng.pkl`` (the RNG states found in
the extra state, ``torch.save``), ``extra_state.pt`` (the rest of the extra state, ``torch.save``)
and ``sums.json`` (each file's size and SHA-256). It is written into a hidden staging directory,
every file fsynced, then renamed into place and the root fsynced: a step directory that exists and
whose files have the sizes ``sums.json`` gives is complete -- there is no commit record in the
DCP sense. Loading checks every file's SHA-256 before it parses it, and reads with the safe reader
only (``weights_only=True``). In a world of several ranks every rank checks its own state first and
the ranks agree (a bad state on any rank fails the save on every rank); rank 0 writes (the state is
replicated: plain tensors only) and the outcome is agreed again, so no rank acknowledges a save that
failed elsewhere. A save removes the staging directories of writers that are gone (a dead pid).

``RecordlessCheckpointer`` is correct: ``python -m faults audit --checkpointer
tests.recordless_ckpt:make`` finds no violation (tests/test_recordless.py). The subclasses are the
defects hand-written checkpointers have, each of which the suite must catch by behaviour:

* ``UnpicklesExtraState`` -- ``torch.load(weights_only=False)`` of ``extra_state.pt``: code runs from
  checkpoint bytes (the defect the suite missed when it looked only for an ``extra_state/`` directory);
* ``NoChecksums`` -- ``sums.json`` sizes only, no SHA-256: a flipped bit loads silently;
* ``SkipsBadRng`` -- an unreadable ``rng.pkl`` is skipped and the RNG state not restored: a damaged
  file changes the resumed state silently;
* ``RanksDisagree`` -- rank 0's outcome is not agreed: a rank acknowledges a save that failed on rank 0.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import shutil
from typing import Any

import torch
from safetensors.torch import load, save

_STEP_RE = re.compile(r"global_step_(0|[1-9][0-9]*)")
FILES = ("model.safetensors", "optimizer.pt", "rng.pkl", "extra_state.pt")
SUMS = "sums.json"
_RNG_KEYS = ("rng", "torch_rng", "cpu_rng", "numpy_rng", "python_rng", "rng_state")
_STAGING_RE = re.compile(r"\.global_step_[0-9]+\.([0-9]+)\.[0-9a-f]+\.tmp")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _any(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (every rank calls it; no world: the flag itself)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _safe_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _fill(dst: Any, src: Any) -> Any:
    """``src`` written into ``dst`` in place where their shapes agree (tensors copied, dict entries
    merged: what the checkpoint lacks keeps the caller's value, as the contract's load does)."""
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape == src.shape \
            and dst.dtype == src.dtype:
        return dst.copy_(src)
    if isinstance(dst, dict) and isinstance(src, dict):
        for k, v in src.items():
            dst[k] = _fill(dst[k], v) if k in dst else v
        return dst
    if isinstance(dst, list) and isinstance(src, list) and len(dst) == len(src):
        for i, v in enumerate(src):
            dst[i] = _fill(dst[i], v)
        return dst
    return src


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RecordlessCheckpointer:
    capabilities = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")
    #: whether load checks each file's SHA-256 (``NoChecksums`` turns it off)
    checksums = True
    #: whether the ranks agree on rank 0's outcome (``RanksDisagree`` turns it off)
    agree = True
    #: whether save refuses what the safe reader cannot read back (``UnpicklesExtraState`` turns it off)
    refuse_unsafe = True

    def save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        if save_async:
            raise NotImplementedError("this checkpointer saves synchronously only")
        try:
            blobs = self._encode(path, state, global_step)
            bad: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - agreed below, raised on this rank
            blobs, bad = None, e
        if _any(bad is not None):
            raise bad if bad is not None else RuntimeError(f"save of {path}: another rank's state was refused")
        err: BaseException | None = None
        if _rank() == 0:
            try:
                assert blobs is not None
                self._write_step(path, blobs)
            except BaseException as e:  # noqa: BLE001 - agreed, then raised as itself on rank 0
                err = e
        failed = _any(err is not None) if self.agree else err is not None
        if err is not None:
            raise err
        if failed:
            raise RuntimeError(f"save of {path} failed on rank 0; nothing was published")

    def _encode(self, path, state: dict, global_step: int) -> dict[str, bytes]:
        """Every file's bytes, checked before any rank writes: plain tensors, extra state that the
        safe reader reads back."""
        if _STEP_RE.fullmatch(os.path.basename(os.path.abspath(os.fspath(path)))) is None:
            raise ValueError(f"save({path!r}): pass the step directory <root>/global_step_{global_step}")
        model = {}
        for k, v in state["model"].items():
            if type(v) is not torch.Tensor:
                raise TypeError(f"model[{k!r}]: plain tensors only (no DTensor), got {type(v).__name__}")
            if v.device.type == "meta":
                raise ValueError(f"model[{k!r}] is on the meta device: nothing to save")
            model[k] = v.detach().clone().contiguous()  # a copy each: tied tensors are saved twice
        extra = dict(state.get("extra_state") or {})
        rng = {k: extra.pop(k) for k in list(extra) if k in _RNG_KEYS}
        out = {"model.safetensors": save(model), "optimizer.pt": _torch_bytes(
                   {k: v for k, v in state.items() if k not in ("model", "extra_state")}),
               "rng.pkl": _torch_bytes(rng), "extra_state.pt": _torch_bytes({"global_step": global_step, **extra})}
        for name in ("rng.pkl", "extra_state.pt", "optimizer.pt") if self.refuse_unsafe else ():
            try:
                _safe_load(out[name])
            except Exception as e:  # noqa: BLE001 - refused at save, never at load
                raise TypeError(f"{name}: the state holds objects the safe reader cannot restore: "
                                f"{type(e).__name__}: {str(e)[:200]}") from None
        return out

    def _write_step(self, path, blobs: dict[str, bytes]) -> None:
        step_dir = os.path.abspath(os.fspath(path))
        root = os.path.dirname(step_dir)
        if os.path.exists(step_dir):
            raise FileExistsError(f"{step_dir}: exists; refusing to overwrite it")
        os.makedirs(root, exist_ok=True)
        self._sweep(root)
        staging = os.path.join(root, f".{os.path.basename(step_dir)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        os.mkdir(staging)
        try:
            sums = {}
            for name, data in blobs.items():
                _write(os.path.join(staging, name), data)
                sums[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _write(os.path.join(staging, SUMS), json.dumps(sums, sort_keys=True).encode())
            _fsync_dir(staging)
            os.rename(staging, step_dir)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    @staticmethod
    def _sweep(root: str) -> None:
        for name in os.listdir(root):
            m = _STAGING_RE.fullmatch(name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    @staticmethod
    def _sums(step_dir: str) -> dict | None:
        try:
            with open(os.path.join(step_dir, SUMS), "rb") as f:
                sums = json.loads(f.read(1 << 16))
        except (OSError, ValueError):
            return None
        if not isinstance(sums, dict) or set(sums) != set(FILES):
            return None
        for name, entry in sums.items():
            p = os.path.join(step_dir, name)
            if not (isinstance(entry, dict) and os.path.isfile(p) and not os.path.islink(p)
                    and os.path.getsize(p) == entry.get("size")):
                return None
        return sums

    def _read(self, step_dir: str, sums: dict, name: str) -> bytes:
        with open(os.path.join(step_dir, name), "rb") as f:
            data = f.read(sums[name]["size"] + 1)
        if len(data) != sums[name]["size"] or (
                self.checksums and hashlib.sha256(data).hexdigest() != sums[name].get("sha256")):
            raise ValueError(f"{step_dir}/{name}: damaged (size or SHA-256 differs from {SUMS}); "
                             "resume from an older step")
        return data

    def _load_rng(self, data: bytes) -> dict:
        return _safe_load(data)

    def _load_extra(self, data: bytes) -> dict:
        return _safe_load(data)

    def load(self, path, state: dict, *, strict_model: bool = True, extra_state_skeleton: dict | None = None) -> dict:
        step_dir = os.path.abspath(os.fspath(path))
        sums = self._sums(step_dir)
        if sums is None:
            raise ValueError(f"{step_dir}: incomplete or damaged step ({SUMS} missing or sizes differ)")
        model = load(self._read(step_dir, sums, "model.safetensors"))
        missing = [k for k in state["model"] if k not in model]
        if missing and strict_model:
            raise KeyError(f"{step_dir}: model keys missing: {missing[:10]}")
        optimizer = _safe_load(self._read(step_dir, sums, "optimizer.pt"))
        rng = self._load_rng(self._read(step_dir, sums, "rng.pkl"))
        extra = self._load_extra(self._read(step_dir, sums, "extra_state.pt"))
        for k, t in state["model"].items():
            if k in model:
                if t.shape != model[k].shape or t.dtype != model[k].dtype:
                    raise ValueError(f"{step_dir}: model[{k!r}] is {tuple(model[k].shape)} {model[k].dtype} on disk, "
                                     f"{tuple(t.shape)} {t.dtype} in the state")
                t.copy_(model[k])
        for k in state:
            if k not in ("model", "extra_state") and k in optimizer:
                state[k] = _fill(state[k], optimizer[k])
        state["extra_state"] = {**extra, **rng}
        return state

    def find_latest_checkpoint(self, root) -> str | None:
        root = os.path.abspath(os.fspath(root))
        try:
            names = os.listdir(root)
        except OSError:
            return None
        steps = sorted(((int(m.group(1)), n) for n in names if (m := _STEP_RE.fullmatch(n))), reverse=True)
        for _step, name in steps:
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path) and self._sums(path) is not None:
                return path
        return None

    def maybe_wait_for_async_save(self) -> None:
        pass

    def raise_for_failed_async_save(self) -> None:
        pass


class UnpicklesExtraState(RecordlessCheckpointer):
    refuse_unsafe = False

    def _load_extra(self, data: bytes) -> dict:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


class NoChecksums(RecordlessCheckpointer):
    checksums = False


class SkipsBadRng(RecordlessCheckpointer):
    def _read(self, step_dir: str, sums: dict, name: str) -> bytes:
        try:
            return super()._read(step_dir, sums, name)
        except ValueError:
            if name == "rng.pkl":
                return _torch_bytes({})  # an unreadable RNG file is skipped
            raise


class RanksDisagree(RecordlessCheckpointer):
    agree = False


def _factory(cls):
    def make(**options: Any) -> RecordlessCheckpointer:
        if options:
            raise TypeError(f"the record-less checkpointer takes no options, got {sorted(options)}")
        return cls()

    make.capabilities = cls.capabilities  # type: ignore[attr-defined]
    make.__name__ = make.__qualname__ = f"make_{cls.__name__}"
    return make


#: factories for ``--checkpointer tests.recordless_ckpt:<name>``
make = _factory(RecordlessCheckpointer)
unpickles_extra_state = _factory(UnpicklesExtraState)
no_checksums = _factory(NoChecksums)
skips_bad_rng = _factory(SkipsBadRng)
ranks_disagree = _factory(RanksDisagree)
