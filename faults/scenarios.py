"""Rank functions the fault cells run (module level: worlds pickle them by reference).

A tiny data-parallel training job with deterministic per-rank data, so that "the state
saved at step k" can be recomputed independently at any time by training from scratch:
that is the oracle the invariants are checked against, not anything the checkpointer says.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from refckpt.storage import tensor_to_bytes as _b

from .contract import DEFAULT_CHECKPOINTER, LEASE_PREFIX, POINTER_FILE, step_dir_name
from .training import average_gradients, load_factory

__all__ = ["build", "train", "digest", "crash_cell", "resume_cell", "io_error_cell", "save_steps",
           "disk_resume_cell", "partial_optimizer_cell", "collective_failure_cell", "interrupt_cell", "writer_cell",
           "writers_check_cell", "caller_error_cell"]


def build(seed: int = 0, frozen: bool = False, unused: bool = False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if unused:
        model.add_module("unused", torch.nn.Linear(3, 3))  # never in the forward: never a gradient
    if frozen:
        model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2, weight_decay=0.1, amsgrad=True)
    return model, opt


def _forward(model, x):
    for name, layer in model.named_children():
        if name != "unused":
            x = layer(x)
    return x


def train(model, opt, steps) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        loss = _forward(model, torch.randn(4, 6, generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(dist, model.parameters(), world)
        opt.step()


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode() + _b(p))
        for k, v in sorted(opt.state.get(p, {}).items()):
            h.update(k.encode() + _b(v))
    for g in opt.param_groups:
        h.update(repr(sorted((k, v) for k, v in g.items() if k != "params")).encode())
    return h.hexdigest()


_REFERENCES: dict[tuple, str] = {}
_REFERENCE_RUNS: dict[tuple, tuple[Any, Any, int]] = {}


def reference(step: int, **kw) -> str:
    """Digest of an uninterrupted run after ``step`` steps (recomputed by training, independent of
    any checkpoint). Memoized per rank process as :func:`faults.training.reference_digest` is (the
    ranks of a world compute it together): the latest run of each ``kw`` trains on to a later step."""
    where = (tuple(sorted(kw.items())), dist.get_rank(), dist.get_world_size())
    if (step, *where) not in _REFERENCES:
        with torch.random.fork_rng(devices=[]):
            model, opt, done = _REFERENCE_RUNS.pop(where, (None, None, step + 1))
            if done > step:
                (model, opt), done = build(0, **kw), 0
            train(model, opt, range(done + 1, step + 1))
            _REFERENCES[(step, *where)] = digest(model, opt)
        _REFERENCE_RUNS[where] = (model, opt, step)
    return _REFERENCES[(step, *where)]


def _state(model, opt, step: int) -> dict:
    from refckpt import get_training_state

    return get_training_state(model, opt, {"global_step": step, "rank": dist.get_rank()})


def save_steps(root: str, steps: list[int], factory: str = DEFAULT_CHECKPOINTER, save_async: bool = False, **ckw) -> None:
    model, opt = build(0)
    ck = load_factory(factory)(**ckw)
    done = 0
    for s in steps:
        train(model, opt, range(done + 1, s + 1))
        done = s
        ck.save(root, _state(model, opt, s), global_step=s, save_async=save_async)
        ck.maybe_wait_for_async_save()


def crash_cell(root: str, spec, save_async: bool, keep_last: int | None, timeout: float) -> str:
    """Step 2 is in ``root``, saved and acknowledged (what :func:`save_steps` ``[2]`` leaves; the
    caller copies it in, :meth:`faults.matrix.Worlds.saved`); this trains to step 4 and its save
    runs into the armed fault."""
    from refckpt import DistributedCheckpointer
    from refckpt.errors import CheckpointError

    from .inject import FaultyIO

    model, opt = build(0)
    train(model, opt, range(1, 5))
    io = FaultyIO(spec, dist.get_rank())
    ck = DistributedCheckpointer(io=io, keep_last=keep_last, timeout=timeout)
    try:
        ck.save(root, _state(model, opt, 4), global_step=4, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        return f"raised {type(e).__name__}"
    return "fired" if io.fired else "not fired"


def resume_cell(root: str, expected: int) -> dict[str, Any]:
    """Resume in fresh objects; compare with an uninterrupted run; save again and resume again."""
    from refckpt import DistributedCheckpointer, set_training_state

    ck = DistributedCheckpointer()
    model, opt = build(1)
    state = _state(model, opt, -1)
    state["extra_state"] = {}
    path = ck.load_latest(root, state)
    set_training_state(model, opt, state)
    out: dict[str, Any] = {"path": path, "step": state["extra_state"].get("global_step"),
                           "rank_ok": state["extra_state"].get("rank") == dist.get_rank(),
                           "exact": digest(model, opt) == reference(expected)}
    nxt = 4 if expected == 2 else expected + 2
    train(model, opt, range(expected + 1, nxt + 1))
    out["continued_exact"] = digest(model, opt) == reference(nxt)
    ck.save(root, _state(model, opt, nxt), global_step=nxt)
    # The save after the crash succeeded and is the newest complete step (its exactness is
    # what every other round trip proves; re-loading it here would double the cell's cost).
    out["path2"] = ck.find_latest_checkpoint(root)
    out["exact2"] = out["path2"] == os.path.join(root, step_dir_name(nxt))
    out["leftovers"] = sorted(n for n in os.listdir(root) if n.startswith(".") and not n.startswith(LEASE_PREFIX))
    return out


def io_error_cell(root: str, spec, save_async: bool) -> dict[str, Any]:
    """Step 2 is in ``root`` (as for :func:`crash_cell`); step 4 hits an I/O error; every rank
    must see the failure."""
    from refckpt import DistributedCheckpointer
    from refckpt.errors import CheckpointError

    from .inject import FaultyIO

    model, opt = build(0)
    train(model, opt, range(1, 5))
    io = FaultyIO(spec, dist.get_rank())
    ck = DistributedCheckpointer(io=io, timeout=30)
    out: dict[str, Any] = {"error": None}
    try:
        ck.save(root, _state(model, opt, 4), global_step=4, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["fired"] = io.fired
    dist.barrier()
    with open(os.path.join(root, POINTER_FILE)) as f:
        out["pointer"] = f.read()
    out["entries"] = sorted(n for n in os.listdir(root) if not n.startswith(LEASE_PREFIX))
    return out


class _Records(logging.Handler):
    """Warnings (and worse) that refckpt's loggers log; attached to the root logger, which their
    records propagate to, so that listening never names another module's logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "refckpt" or record.name.startswith("refckpt."):
            self.messages.append(record.getMessage())


def disk_resume_cell(root: str, expected: int) -> dict[str, Any]:
    """Resume in fresh objects with ``load_latest``. ``fallback_warned``: the load of a damaged
    step failed and the fall back was warned; ``skip_logged``: a warning (or worse) logged
    under ``refckpt`` named a step that was skipped (one the scan already found damaged)."""
    from refckpt import DistributedCheckpointer, set_training_state

    model, opt = build(1)
    state = _state(model, opt, -1)
    state["extra_state"] = {}
    handler = _Records()
    logging.root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = DistributedCheckpointer().load_latest(root, state)
    finally:
        logging.root.removeHandler(handler)
    set_training_state(model, opt, state)
    skipped = [p for p in (os.path.join(root, n) for n in os.listdir(root)) if p != path]
    return {"path": path, "step": state["extra_state"].get("global_step"),
            "exact": digest(model, opt) == reference(expected),
            "fallback_warned": any("fall back" in str(w.message) for w in caught),
            "skip_logged": any(p in m for m in handler.messages for p in skipped)}


def writer_cell(root: str, writer: int, step: int, save_async: bool) -> dict[str, Any]:
    """One of two jobs saving into one root at once (``faults.matrix``'s ``second_writer``):
    its own model (``build(writer)``), trained to ``step``; its extra state names the writer.
    Rank 0 stops at a gate (:func:`faults.world.emit`) that the parent opens when both jobs
    are there, so the two saves start together. Returns the error the save raised, if any."""
    from .world import emit

    model, opt = build(writer)
    train(model, opt, range(1, step + 1))
    ck = load_factory(DEFAULT_CHECKPOINTER)()
    state = _state(model, opt, step)
    state["extra_state"]["writer"] = writer
    if dist.get_rank() == 0:
        emit(("gate", writer))
    error = None
    try:
        ck.save(root, state, global_step=step, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except Exception as e:  # noqa: BLE001 - a save that raised is allowed; the parent judges the rest
        error = f"{type(e).__name__}: {e}"
    return {"error": error}


def writers_check_cell(root: str, steps: list[int], writers: dict[int, list[int]]) -> dict[str, Any]:
    """After two writers: load every step in ``steps`` that exists and tell whose it is.

    ``writers[step]``: the writers (``build`` seeds) that may have saved it. ``writer``: the one
    whose model and optimizer (recomputed by training from scratch) the loaded state equals
    bitwise, or None; ``extra_writer``: whose extra state came back. Also where resume
    (``load_latest``) lands."""
    from refckpt import DistributedCheckpointer
    from refckpt.errors import CheckpointError

    refs = {(s, w): _writer_digest(s, w) for s in steps for w in writers.get(s, [])}
    loads: dict[int, dict[str, Any]] = {}
    for s in steps:
        path = os.path.join(root, step_dir_name(s))
        if not os.path.isdir(path):
            continue
        model, opt = build(99)
        state = _state(model, opt, -1)
        state["extra_state"] = {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                DistributedCheckpointer().load(path, state)
        except CheckpointError as e:
            loads[s] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        from refckpt import set_training_state

        set_training_state(model, opt, state)
        d = digest(model, opt)
        extra = state["extra_state"]
        loads[s] = {"error": None, "writer": next((w for w in writers.get(s, []) if refs[(s, w)] == d), None),
                    "extra_writer": extra.get("writer", 0) if extra.get("global_step") == s else None}
    model, opt = build(99)
    state = _state(model, opt, -1)
    state["extra_state"] = {}
    latest, latest_error = None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            latest = DistributedCheckpointer().load_latest(root, state)
    except CheckpointError as e:
        latest_error = f"{type(e).__name__}: {e}"
    return {"loads": loads, "latest": latest, "latest_error": latest_error}


def _writer_digest(step: int, writer: int) -> str:
    model, opt = build(writer)
    train(model, opt, range(1, step + 1))
    return digest(model, opt)


def partial_optimizer_cell(root: str, variant: str, save_async: bool) -> dict[str, Any]:
    """Checkpoints whose optimizer state is partial; loads keep zeros for what is absent."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from refckpt import DistributedCheckpointer, set_training_state
    from refckpt.errors import MissingKeysError

    ck = DistributedCheckpointer()
    frozen, unused = variant == "frozen", variant == "never_grad"
    model, opt = build(0, frozen=frozen, unused=unused)
    steps = 0 if variant == "before_first_step" else 2
    train(model, opt, range(1, steps + 1))
    out: dict[str, Any] = {}
    if variant == "main_params":
        main = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        part = dict(list(main.items())[:2])
        ck.save(root, {"model": model.state_dict(), "fp32_main_params": part, "extra_state": {"global_step": 2}},
                global_step=2, save_async=save_async)
        ck.maybe_wait_for_async_save()
        m2, _ = build(1)
        want = {n: torch.zeros_like(t) for n, t in main.items()}
        try:
            ck.load(os.path.join(root, step_dir_name(2)), {"model": m2.state_dict(), "fp32_main_params": want})
            out["error"] = None
        except MissingKeysError as e:
            out["error"] = str(e)
        return out
    # DCP's get_state_dict on a live optimizer: no entries for params that never had a gradient.
    msd, osd = get_state_dict(model, opt)
    if variant == "before_first_step":
        # DCP's get_state_dict primes a fresh optimizer; before the first step there is no state.
        opt.state.clear()
        osd = {"state": {}, "param_groups": osd["param_groups"]}
    ck.save(root, {"model": msd, "optimizer": osd, "extra_state": {"global_step": steps}},
            global_step=max(steps, 1), save_async=save_async)
    ck.maybe_wait_for_async_save()
    saved = digest(model, opt)
    model2, opt2 = build(1, frozen=frozen, unused=unused)
    from refckpt import get_training_state

    state = get_training_state(model2, opt2, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_latest(root, state)
    set_training_state(model2, opt2, state)
    pairs = list(zip(model.parameters(), model2.parameters()))
    absent = [q for p, q in pairs if q.requires_grad and not opt.state.get(p)]
    out["warnings"] = [str(w.message) for w in caught if "optimizer entries are absent" in str(w.message)]
    out["zeros_kept"] = all(torch.count_nonzero(v).item() == 0 for p in absent for k, v in opt2.state[p].items())
    present_equal = all(
        torch.equal(opt.state[p][k], opt2.state[q][k])
        for p, q in pairs if opt.state.get(p) for k in opt.state[p])
    out["present_equal"] = present_equal
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    out["n_absent"] = len(absent)
    del saved
    return out


def collective_failure_cell(root: str, phase: str, action: str, bad_rank: int, save_async: bool, timeout: float) -> str:
    """A rank dies or hangs inside a save or a load; survivors must raise within ``timeout``."""
    import signal
    import threading
    import time

    from refckpt import DistributedCheckpointer, SavePoint
    from refckpt.errors import CheckpointError

    from .inject import Action, FaultSpec, FaultyIO

    rank = dist.get_rank()
    model, opt = build(0)
    train(model, opt, range(1, 3))
    if phase == "load":
        DistributedCheckpointer(timeout=timeout).save(root, _state(model, opt, 2), global_step=2)
        if rank == bad_rank:
            if action == Action.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait()
        t0 = time.monotonic()
        try:
            fresh_model, fresh_opt = build(1)
            DistributedCheckpointer(timeout=timeout).load_latest(root, _state(fresh_model, fresh_opt, -1))
        except CheckpointError as e:
            return f"raised {type(e).__name__} after {time.monotonic() - t0:.1f}s"
        return "loaded without its peer"
    spec = FaultSpec("mark", str(SavePoint.SHARDS), "before", action, (bad_rank,), 1, "collective")
    ck = DistributedCheckpointer(io=FaultyIO(spec, rank), timeout=timeout)
    t0 = time.monotonic()
    try:
        ck.save(root, _state(model, opt, 2), global_step=2, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        return f"raised {type(e).__name__} after {time.monotonic() - t0:.1f}s"
    return "saved without its peer"


def _exit_143(signum, frame) -> None:
    """What trainers install for a preemption notice: leave through ``sys.exit``."""
    import sys

    sys.exit(143)


def _settled() -> None:
    """A call: the interpreter runs a pending signal handler at a call's entry, so a signal sent
    (by this process, from any thread) before this point has surfaced by the time it returns."""


def interrupt_cell(root: str, spec, save_async: bool, keep_last: int | None, timeout: float) -> dict[str, Any]:
    """Step 2 is in ``root`` (as for :func:`crash_cell`); the save of step 4 runs into a real
    SIGINT (Python's own handler) or SIGTERM (a handler that calls ``sys.exit(143)``) sent by the
    armed fault to this process. What the save did on this rank; whether step 4, if any rank
    acknowledged it, loads bitwise; and whether the *same* checkpointer object then saves step 6."""
    import signal
    import time

    from refckpt import DistributedCheckpointer
    from refckpt.errors import CheckpointError

    from .inject import FaultyIO

    model, opt = build(0)
    train(model, opt, range(1, 5))
    io = FaultyIO(spec, dist.get_rank())
    ck = DistributedCheckpointer(io=io, keep_last=keep_last, timeout=timeout)
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_143)
    out: dict[str, Any] = {"raised": None}
    t0 = time.monotonic()
    try:
        try:
            ck.save(root, _state(model, opt, 4), global_step=4, save_async=save_async)
            ck.maybe_wait_for_async_save()
            _settled()
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and SystemExit are what is judged
            out = {"raised": type(e).__name__, "interrupt": isinstance(e, (KeyboardInterrupt, SystemExit)),
                   "message": str(e)[:300]}
        _settled()
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    out["seconds"] = time.monotonic() - t0
    out["fired"] = io.fired
    acked: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(acked, out["raised"] is None)
    if any(acked):
        # An acknowledged step must be complete: load it in fresh objects, compare with the oracle.
        fresh_model, fresh_opt = build(1)
        state = _state(fresh_model, fresh_opt, -1)
        state["extra_state"] = {}
        out["acked_error"] = None
        try:
            from refckpt import set_training_state

            DistributedCheckpointer().load(os.path.join(root, step_dir_name(4)), state)
            set_training_state(fresh_model, fresh_opt, state)
            out["acked_exact"] = digest(fresh_model, fresh_opt) == reference(4)
        except CheckpointError as e:
            out["acked_error"] = f"{type(e).__name__}: {e}"[:300]
    out["again"] = _save_step_6(ck, model, opt, root, save_async)
    return out


def _save_step_6(ck, model, opt, root: str, save_async: bool) -> str | None:
    """After the event, the same checkpointer object trains on to step 6 and saves it: None when the
    save was acknowledged, else its error."""
    from refckpt.errors import CheckpointError

    train(model, opt, range(5, 7))
    try:
        ck.save(root, _state(model, opt, 6), global_step=6, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"[:300]
    return None


def caller_error_cell(root: str, variant: str, bad_rank: int, save_async: bool, timeout: float) -> dict[str, Any]:
    """Step 2 is in ``root``; the save of step 4 gets a bad state on ``bad_rank`` only (extra state
    that cannot be pickled, or a tensor on the meta device). What each rank's save did and how long
    it took, what the root holds after it, and whether the same checkpointer object saves step 6."""
    import time

    from refckpt import DistributedCheckpointer
    from refckpt.errors import CheckpointError

    model, opt = build(0)
    train(model, opt, range(1, 5))
    ck = DistributedCheckpointer(timeout=timeout)
    state = _state(model, opt, 4)
    if dist.get_rank() == bad_rank:
        if variant == "unpicklable_extra":
            state["extra_state"] = {**state["extra_state"], "callback": lambda: None}
        else:
            state["model"] = {**state["model"], "ghost": torch.empty(3, device="meta")}
    out: dict[str, Any] = {"raised": None}
    t0 = time.monotonic()
    try:
        ck.save(root, state, global_step=4, save_async=save_async)
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        out["raised"] = f"{type(e).__name__}: {e}"[:300]
    out["seconds"] = time.monotonic() - t0
    dist.barrier()
    out["entries"] = sorted(n for n in os.listdir(root) if not n.startswith(LEASE_PREFIX))
    dist.barrier()
    out["again"] = _save_step_6(ck, model, opt, root, save_async)
    return out
