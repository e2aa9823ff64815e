"""Rank functions for ``tests/test_adapter_veomni.py``: module level, so that a
:class:`faults.world.World` pickles them by reference and its ranks import them from here.

VeOmni's checkpointer calls ``dist.get_rank()`` unguarded (its per-rank extra state), so every
save and load runs inside a world, even a 1-rank one. Saves here are async unless a test is
about sync saves: on a host without CUDA/NPU/MLU, VeOmni's sync save raises after writing (it
calls ``torch.cpu.empty_cache``, which torch does not have)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from typing import Any

from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, _error, reference_digest

#: VeOmni's writer: FileSystemWriter(thread_count=16, single_file_per_rank=True) -> 16 files a rank
SHARDS_PER_RANK = 16


def step_dir(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), f"global_step_{step}")


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's overwrite notice, torch's pickle notice
        yield


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def guarded(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``fn(*args)``, or ``{"error": ...}`` when it raises (so that the world stays alive)."""
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which judges it
        return {"error": _error(e)}


def _save(ck, root: str, run: TrainRun, save_async: bool = True) -> str:
    path = step_dir(root, run.step)
    ck.save(path, run.state(), global_step=run.step, save_async=save_async)
    ck.maybe_wait_for_async_save()
    return path


def _resume(ck, root: str, cfg: RunConfig) -> dict[str, Any]:
    """What a restarted job does: fresh run, ``find_latest_checkpoint``, ``load`` with a skeleton,
    ``apply``."""
    fresh = TrainRun(cfg)
    path = ck.find_latest_checkpoint(root)
    out: dict[str, Any] = {"path": path, "same_dict": None}
    if path is not None:
        state = fresh.state(target=True)
        skeleton = state.pop("extra_state")
        loaded = ck.load(path, state, extra_state_skeleton=skeleton)
        out["same_dict"] = loaded is state
        fresh.apply(loaded)
    out.update(step=fresh.step, digest=fresh.digest(), reference=reference_digest(cfg, fresh.step))
    return out


def round_trip(root: str, cfg: RunConfig, save_async: bool | tuple[bool, ...], steps: tuple[int, ...] = (2, 3),
               train_after: int = 2) -> dict[str, Any]:
    """Train and save at each of ``steps`` (``save_async`` for every save, or one flag per save),
    train ``train_after`` more steps (while the last async save may still run), wait; then a
    fresh run and checkpointer resume the root."""
    from faults.adapters.veomni import VeOmni

    flags = save_async if isinstance(save_async, tuple) else (save_async,) * len(steps)
    with _quiet():
        run, ck = TrainRun(cfg), VeOmni()
        for s, asynchronous in zip(steps, flags):
            run.train_to(s)
            ck.save(step_dir(root, s), run.state(), global_step=s, save_async=asynchronous)
            ck.raise_for_failed_async_save()
        run.train_to(run.step + train_after)
        ck.maybe_wait_for_async_save()
        ck.maybe_wait_for_async_save()  # nothing pending: a no-op
        ck.raise_for_failed_async_save()
        out = _resume(VeOmni(), root, cfg)
        out["listing"] = sorted(os.listdir(root))
        return out


def sync_save(root: str) -> dict[str, Any]:
    """One sync save: its error (if any), and what it left behind (found, loadable, bitwise)."""
    from faults.adapters.veomni import VeOmni

    cfg = RunConfig()
    with _quiet():
        run, ck = TrainRun(cfg), VeOmni()
        run.train_to(1)
        out: dict[str, Any] = {"error": None}
        try:
            ck.save(step_dir(root, 1), run.state(), global_step=1)
        except BaseException as e:  # noqa: BLE001
            out["error"] = _error(e)
        out.update(_resume(VeOmni(), root, cfg))
        return out


def _tree(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _metadata_keys(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(path).read_metadata().state_dict_metadata)


def cross_check(root: str, cfg: RunConfig, step: int = 2) -> dict[str, Any]:
    """VeOmni's own ``DistributedCheckpointer.save``/``load`` with live objects, the way its trainer
    calls them, against the adapter: a checkpoint either one writes, the other loads, bitwise."""
    from veomni.checkpoint import build_checkpointer

    from faults.adapters.veomni import VeOmni

    native = build_checkpointer(ckpt_manager="dcp", dist_backend="fsdp2")
    with _quiet():
        run = TrainRun(cfg)
        run.train_to(step)
        native_dir = os.path.join(root, "native", f"global_step_{step}")
        # CheckpointerCallback._save_checkpoint: the step directory, live model and optimizer(s)
        native.save(native_dir, {"model": run.model, "optimizer": run.opts, "extra_state": run.extra()},
                    save_async=True)
        native.wait_for_pending_save()
        adapter_dir = _save(VeOmni(), os.path.join(root, "adapter"), run)
        out: dict[str, Any] = {"native_tree": _tree(native_dir), "adapter_tree": _tree(adapter_dir),
                               "native_keys": _metadata_keys(native_dir), "adapter_keys": _metadata_keys(adapter_dir),
                               "reference": reference_digest(cfg, step)}
        # the adapter loads VeOmni's own checkpoint
        out["adapter_loads_native"] = _resume(VeOmni(), os.path.dirname(native_dir), cfg)["digest"]
        # VeOmni's own load (CheckpointerCallback._load_checkpoint) reads the adapter's checkpoint
        fresh = TrainRun(cfg)
        state = {"model": fresh.model, "optimizer": fresh.opts, "extra_state": {}}
        native.load(adapter_dir, state)
        fresh.step = state["extra_state"]["global_step"]
        fresh.gen.set_state(state["extra_state"]["rng"])
        out["native_loads_adapter"] = fresh.digest()
        return out


def _block_shards(path: str) -> None:
    """Every shard file this rank would write is a directory: opening it fails in whichever
    writer thread takes it, the calling one included."""
    for i in range(SHARDS_PER_RANK):
        os.makedirs(os.path.join(path, f"__{_rank()}_{i}.distcp"))


def async_failure(root: str, how: str) -> dict[str, Any]:
    """An async save whose background write fails, then ``how`` = "wait" | "poll" | "next_save":
    what each call raised (None: returned), and what a resume then finds."""
    import concurrent.futures

    from faults.adapters.veomni import VeOmni

    with _quiet():
        run, ck = TrainRun(RunConfig()), VeOmni()
        run.train_to(1)
        path = step_dir(root, 1)
        _block_shards(path)
        ck.save(path, run.state(), global_step=1, save_async=True)
        errors: list[str | None] = []

        def attempt(fn) -> None:
            try:
                fn()
                errors.append(None)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is not an Exception
                errors.append(_error(e))

        if how == "wait":
            attempt(ck.maybe_wait_for_async_save)
            attempt(ck.maybe_wait_for_async_save)
            attempt(ck.raise_for_failed_async_save)
        elif how == "poll":
            concurrent.futures.wait([ck._ck.save_future])  # the background save has ended; nothing consumed
            attempt(ck.raise_for_failed_async_save)
            attempt(ck.raise_for_failed_async_save)
            attempt(ck.maybe_wait_for_async_save)
        else:  # the next async save raises the earlier failure before it starts writing
            run.train_to(2)
            attempt(lambda: ck.save(step_dir(root, 2), run.state(), global_step=2, save_async=True))
            attempt(ck.maybe_wait_for_async_save)
        step2 = step_dir(root, 2)
        return {"errors": errors, "latest": VeOmni().find_latest_checkpoint(root),
                "step2": sorted(os.listdir(step2)) if os.path.isdir(step2) else None}


def running_save_is_left_alone(root: str) -> dict[str, Any]:
    """``raise_for_failed_async_save`` while the async save is still running leaves it pending
    (the write is held up on the storage writer's ``write_data``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    from faults.adapters.veomni import VeOmni

    gate = threading.Event()
    original = FileSystemWriter.write_data

    def held(self, plan, planner):
        gate.wait(30)
        return original(self, plan, planner)

    FileSystemWriter.write_data = held
    try:
        with _quiet():
            run, ck = TrainRun(RunConfig()), VeOmni()
            run.train_to(1)
            ck.save(step_dir(root, 1), run.state(), global_step=1, save_async=True)
            ck.raise_for_failed_async_save()
            pending = ck._ck.save_future is not None and not ck._ck.save_future.done()
            gate.set()
            ck.maybe_wait_for_async_save()
            return {"pending_after_poll": pending, "latest": ck.find_latest_checkpoint(root),
                    "cleared": ck._ck.save_future is None}
    finally:
        FileSystemWriter.write_data = original
        gate.set()


def extra_state_behaviour(root: str) -> dict[str, Any]:
    """Extra state only with a skeleton; the skeleton is replaced, not filled; per-rank files;
    strict_model; partial optimizer state."""
    import torch

    from faults.adapters.veomni import VeOmni

    with _quiet():
        cfg = RunConfig()
        run, ck = TrainRun(cfg), VeOmni()
        run.train_to(2)
        path = _save(ck, root, run)
        fresh = TrainRun(cfg)
        state = fresh.state(target=True)
        state.pop("extra_state")
        out: dict[str, Any] = {}
        out["no_skeleton_same"] = ck.load(path, state) is state
        out["no_skeleton_has_extra"] = "extra_state" in state
        marker = {"global_step": -1}
        state["extra_state"] = marker
        ck.load(path, state)
        out["marker_untouched"] = state["extra_state"] is marker and marker == {"global_step": -1}
        skeleton = fresh.extra()
        ck.load(path, state, extra_state_skeleton=skeleton)
        out["skeleton_untouched"] = skeleton["global_step"] == 0
        out["loaded_step"] = state["extra_state"]["global_step"]
        out["rng_equal"] = torch.equal(state["extra_state"]["rng"], run.extra()["rng"])
        out["rank"] = state["extra_state"].get("rank")
        out["files"] = sorted(os.listdir(os.path.join(path, "extra_state")))
        # strict_model: a model key the checkpoint lacks raises; strict_model=False loads
        state["model"]["not_in_checkpoint"] = state["model"]["out.bias"].clone()
        try:
            ck.load(path, state)
            out["strict_error"] = None
        except BaseException as e:  # noqa: BLE001
            out["strict_error"] = _error(e)
        ck.load(path, state, strict_model=False)
        # an optimizer entry the checkpoint lacks is tolerated (VeOmni's planner allows partial
        # optimizer state), and so is a state without "optimizer"
        target = fresh.state(target=True)
        target["optimizer"]["state"]["not_a_param"] = {"exp_avg": torch.zeros(2)}
        ck.load(path, {"model": target["model"], "optimizer": target["optimizer"]})
        ck.load(path, {"model": target["model"]})
        try:
            ck.load(path, {"optimizer": target["optimizer"]})
            out["no_model_error"] = None
        except BaseException as e:  # noqa: BLE001
            out["no_model_error"] = _error(e)
        return out


# -- evidence of VeOmni defects ----------------------------------------------------------------


def failed_worker_write(root: str) -> dict[str, Any]:
    """ENOSPC in one of the 15 extra writer threads that VeOmni's ``thread_count=16`` makes DCP
    start (the calling thread writes normally): does the save fail, and can the step it left be
    loaded?"""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from faults.adapters.veomni import VeOmni

    original = FileSystem.create_stream
    injected: list[str] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and "_write_files_from_queue" in threading.current_thread().name and not injected:
            injected.append(str(path))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        with original(self, path, mode) as stream:
            yield stream

    cfg = RunConfig()
    FileSystem.create_stream = create_stream
    out: dict[str, Any] = {"save_error": None}
    try:
        with _quiet(), open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # excepthook
            run, ck = TrainRun(cfg), VeOmni()
            run.train_to(1)
            try:
                _save(ck, root, run)
            except BaseException as e:  # noqa: BLE001
                out["save_error"] = _error(e)
    finally:
        FileSystem.create_stream = original
    out["injected"] = injected
    with _quiet():
        out["latest"] = VeOmni().find_latest_checkpoint(root)
        out["resume"] = guarded(_resume, VeOmni(), root, cfg)
    return out


def dropped_entries(root: str) -> dict[str, Any]:
    """``save`` keeps only "model" and "optimizer" (and the extra-state files): an fp32 main-
    parameter branch is dropped without a word, and a resume does not get it back."""
    cfg = RunConfig(ModelSpec(dtype="bfloat16"), OptimSpec(("adamw",), main_fp32=True))
    out = round_trip(root, cfg, True, steps=(2,), train_after=0)
    out["keys"] = _metadata_keys(step_dir(root, 2))
    return out


class _RunsOnLoad:
    """Pickled into an extra-state file: unpickling it calls ``_touch(path)``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path: str) -> str:
    with open(path, "w") as f:
        f.write("executed while loading a checkpoint\n")
    return "ran"


def code_from_extra_state(root: str) -> dict[str, Any]:
    """A step whose extra-state file holds a pickle that calls a function: does ``load`` call it?"""
    import torch

    from faults.adapters.veomni import VeOmni

    with _quiet():
        cfg = RunConfig()
        run, ck = TrainRun(cfg), VeOmni()
        run.train_to(1)
        path = _save(ck, root, run)
        marker = os.path.join(root, "marker")
        torch.save({"global_step": 1, "payload": _RunsOnLoad(marker)},
                   os.path.join(path, "extra_state", f"extra_state_rank_{_rank()}.pt"))
        state = TrainRun(cfg).state(target=True)
        skeleton = state.pop("extra_state")
        out = guarded(lambda: {"error": None, "loaded": repr(ck.load(path, state, extra_state_skeleton=skeleton)
                                                             ["extra_state"].get("payload"))})
        out["executed"] = os.path.exists(marker)
        return out


def load_writes(root: str) -> dict[str, Any]:
    """``load`` (with a skeleton) of a step whose extra-state directory is gone: does it write
    into the checkpoint?"""
    from faults.adapters.veomni import VeOmni

    with _quiet():
        cfg = RunConfig()
        run, ck = TrainRun(cfg), VeOmni()
        run.train_to(1)
        path = _save(ck, root, run)
        shutil.rmtree(os.path.join(path, "extra_state"))
        state = TrainRun(cfg).state(target=True)
        skeleton = state.pop("extra_state")
        out = guarded(lambda: {"error": None, "_": ck.load(path, state, extra_state_skeleton=skeleton) and None})
        out["created"] = os.path.isdir(os.path.join(path, "extra_state"))
        return out
