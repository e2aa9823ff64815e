"""Host copies of a state tree for async saves: what the caller of ``save(save_async=True)`` waits for.

An async save returns once every tensor has been copied to host memory the caller can no
longer reach; the background thread then writes from those copies while training mutates the
originals. The copy is the whole of the caller's cost, so it is made cheap:

* **Buffers are reused across saves** (``reuse=True``): a fresh ``torch.empty`` of the
  state's size pays one page fault per 4 KiB page on first touch, which on the 2-core
  reference machine made a clone of the state 3-6x slower than copying into memory that is
  already mapped (``python -m benchmarks``: ``memcpy`` vs ``refckpt_async_blocked``).
  The price is one host copy of the state held between saves, as DCP's cached stager and
  torchtitan's pinned-memory async mode do; ``reuse=False`` frees it after each save.
* **CPU copies run on several threads** (tensor copies release the GIL): one thread does not
  saturate memory bandwidth on common machines; large tensors are split into pieces.
* **Device tensors go to pinned host memory** with non-blocking copies and one synchronize
  per device type at the end, so device-to-host transfers run at full DMA speed.

A buffer is reused only for a tensor at the same place in the tree with the same shape, dtype,
strides and pinning; anything else gets a new buffer. The previous save's background write
must have finished before :meth:`Stager.stage` or :meth:`Stager.plan` runs (``save`` waits for it
first).

**Deferred snapshots** (``save(..., save_async=True, snapshot="deferred")``): :meth:`Stager.plan`
only records, on the caller's thread, which tensor goes into which buffer and each tensor's
version counter (``tensor._version``, which every in-place op through the tensor, a view of it or
its ``detach()`` increments); :meth:`DeferredCopy.copy` makes the copies later, on the background
thread. Correctness is guarded, never assumed:

* while the copy is pending, a global optimizer step pre-hook makes every ``optimizer.step``
  wait for the whole copy (parameters and optimizer state change there);
* and a global module forward pre-hook guards the **buffers of the module's subtree**: the
  registered buffers of the module and of every module below it (``module.buffers()``), whoever
  updates them in that forward -- BatchNorm's own forward, a parent's
  ``F.batch_norm(x, self.child.running_mean, self.child.running_var, training=True)``, a
  ``DistributedDataParallel``'s broadcast into the buffers of the module it wraps. None of these
  updates bumps the saved tensor's version counter (BatchNorm's in-kernel update of the running
  statistics does not; DDP's broadcast runs under ``_unsafe_preserve_version_counter``), so they
  must land after the copy of what they change. The forward does not wait for the whole copy:
  the hook *claims* the still pending copies of those buffers and makes them itself, on the
  caller's thread, before the forward runs (a blocking copy, ordered on the caller's current
  stream for device tensors), and waits only for those of them the background copier is
  copying right now (on an accelerator: until its device copies are synchronized). Each job is
  pending, being copied (by the background or by a caller that claimed it) or done, under one
  lock; the background copier skips claimed jobs and, before the check below, waits for the
  claimed copies to end. A module's subtree jobs are computed once per deferred save, the first
  time the module runs (from its children's, cached by module identity), and once they are all
  done its forward costs one dict lookup; after the copy has ended the hook returns at once.
  **Parameters are not guarded by the forward hook**: an in-place change of a parameter bumps
  its version counter and fails the save loudly (below), and waiting for the parameters would
  stall every forward until the whole state (parameters and optimizer moments: gigabytes) is
  copied, which is what a deferred save exists to avoid;
* after the whole copy (device copies synchronized), every tensor's version is compared with
  the one recorded at the call (a DTensor's own, which its in-place ops bump, and its local
  shard's): a tensor changed in place in between (a mutation before or during its copy, or after
  it and before the copy's end) fails the save with :class:`~refckpt.errors.SnapshotChangedError`,
  naming it; it is never written. A buffer a forward let through (copied by it, or found copied
  by the background) is compared instead when that forward passes the hook, after its copy and
  before the forward runs, on the caller's thread and under the jobs' lock: the forward goes on
  to change it, legitimately (BatchNorm's ``num_batches_tracked.add_(1)`` bumps the version; DDP's
  broadcast bumps it until it restores it), so a change before its copy fails the save and one
  after it is not in the snapshot;
* on an accelerator the copies run on the background thread's stream after an event recorded on
  the caller's current stream at the call, so they see every kernel queued before ``save()``.

Outside the guards, neither waited for nor detected (``tests/test_deferred_guard.py`` shows each):

* writes that bypass autograd's version tracking: through ``tensor.data``, a ``.numpy()`` view, a
  DTensor parameter's own ``to_local()``, an in-place collective such as ``dist.broadcast`` into a
  saved tensor outside a forward;
* version-less updates (BatchNorm-style kernels, anything under
  ``torch.autograd._unsafe_preserve_version_counter``) of a buffer that is not in the subtree of
  the module whose forward makes them: a buffer of another module reached through an unregistered
  reference (a plain attribute set with ``object.__setattr__``, a closure) whose owner's forward
  is not called, or such an update made outside any hooked forward (in the training loop itself,
  or in a ``module.forward(x)`` called directly, which skips the hooks; the modules it calls
  still run them).

Updates outside the guards that do bump the version counter (an in-place op on a parameter, on
optimizer state, or on a buffer outside a guarding forward) are not waited for but detected: the
save fails, as above.

Make them after ``maybe_wait_for_async_save()``, or save with ``snapshot="copy"``. The hooks are
removed on the caller's thread (``raise_for_failed_async_save``,
``maybe_wait_for_async_save``, the next ``save``, ``close``), never from the background thread:
removing an optimizer hook while ``optimizer.step`` iterates over the hooks would break that step.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading
from typing import Any

import torch

from .errors import SnapshotChangedError

__all__ = ["Stager", "DeferredCopy", "accelerator_available"]

_PIECE = 8 << 20  # bytes per parallel copy job
_SMALL = 1 << 20  # tensors below this are copied on the calling thread


def accelerator_available() -> bool:
    """Whether a CUDA/NPU/other accelerator is present (pinned staging then pays off)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        try:
            return bool(acc.is_available())
        except RuntimeError:  # pragma: no cover - broken driver installs
            return False
    return torch.cuda.is_available()  # pragma: no cover - torch without torch.accelerator


class Stager:
    """Copies state trees to host memory; see the module docstring."""

    def __init__(self, *, pin: bool, reuse: bool = True, threads: int | None = None) -> None:
        self.pin = pin
        self.reuse = reuse
        self.threads = max(1, min(4, os.cpu_count() or 1) if threads is None else threads)
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def held_bytes(self) -> int:
        """Host memory kept for the next save."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in host memory owned by the stager."""
        return self._copy(self._plan(obj, check=False))

    def plan(self, obj: Any) -> DeferredCopy:
        """Record, without copying, what :meth:`stage` would copy (a deferred snapshot): the
        tree of host buffers, which tensor goes into which, and each tensor's version now.
        Non-tensor leaves are copied now; so are tensors whose version cannot be tracked
        (inference tensors). :meth:`DeferredCopy.copy` makes the copies."""
        return self._plan(obj, check=True)

    def _plan(self, obj: Any, *, check: bool) -> DeferredCopy:
        jobs: list[_Job] = []
        seen: dict[tuple, torch.Tensor] = {}
        out = self._walk(obj, (), jobs, seen, check)
        self._bufs = seen if self.reuse else {}
        return DeferredCopy(self, out, jobs, _ready_events(jobs) if check else {})

    def _copy(self, plan: DeferredCopy) -> Any:
        big: list[tuple[torch.Tensor, torch.Tensor]] = []
        big_jobs: list[_Job] = []
        device_jobs: list[_Job] = []
        devices: set[str] = set()
        for device, ev in plan.ready.items():  # deferred, on the background thread: after what preceded save()
            if ev is not None:
                torch.accelerator.current_stream(device).wait_event(ev)
        for job in plan.jobs:
            if not plan._take(job):  # a forward claimed it: copied on the training thread
                continue
            out, t = job.dst, job.src
            if t.device.type != "cpu":
                devices.add(t.device.type)
                out.copy_(t, non_blocking=out.is_pinned())
                device_jobs.append(job)
            elif t.numel() * t.element_size() >= _SMALL and t.is_contiguous() and out.is_contiguous():
                big.append((out, t))
                big_jobs.append(job)
            else:
                out.copy_(t)
                plan._finish((job,))
        self._copy_parallel(big)
        plan._finish(big_jobs)
        for device, ev in plan.ready.items():  # only this thread's copies, not the training loop's queued work
            if ev is not None:
                torch.accelerator.current_stream(device).record_event().synchronize()
        devices -= {d.type for d, ev in plan.ready.items() if ev is not None}
        devices |= {d.type for d, ev in plan.ready.items() if ev is None}
        for dev in devices:
            mod = getattr(torch, dev, None)
            if mod is not None and hasattr(mod, "synchronize"):
                mod.synchronize()
        plan._finish(device_jobs)
        return plan.tree

    def release(self) -> None:
        """Free the reused buffers and the copy threads."""
        self._bufs = {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- internals ------------------------------------------------------------------------
    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        pin = self.pin and t.device.type != "cpu"
        old = self._bufs.get(path)
        if (old is not None and old.shape == t.shape and old.dtype == t.dtype
                and old.stride() == t.stride() and old.is_pinned() == pin):
            return old
        return torch.empty_like(t, device="cpu", pin_memory=pin)

    def _walk(self, obj: Any, path: tuple, jobs: list[_Job], seen: dict, check: bool) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):  # the local shard is what is copied
            n = len(jobs)
            # the local shard itself (to_local() returns a view of it through an autograd function:
            # the same memory and version counter, at ~0.1 ms a call)
            shard = getattr(obj, "_local_tensor", None)
            local = self._walk(shard if isinstance(shard, torch.Tensor) else obj.to_local(), path + ("<local>",),
                               jobs, seen, check)
            if check and len(jobs) > n:
                # DTensor ops (an optimizer's, a user's p.mul_()) bump the DTensor's version counter,
                # which its detached aliases share, not the local shard's: check both
                jobs[-1].wrapper, jobs[-1].wrapper_version = obj, obj._version
            return _dtensor_like(obj, local)
        if isinstance(obj, torch.Tensor):
            t = obj.detach()  # shares the version counter of obj
            out = self._buffer(path, t)
            seen[path] = out
            if check and t.is_inference():  # no version counter to check later: copy now
                out.copy_(t)
            else:
                jobs.append(_Job(path, out, t, t._version if check else -1))
            return out
        if isinstance(obj, dict):
            items = {k: self._walk(v, path + (k,), jobs, seen, check) for k, v in obj.items()}
            return items if type(obj) is dict else type(obj)(items.items())
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), jobs, seen, check) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(v, path + (i,), jobs, seen, check) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_parallel(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        if self.threads == 1:
            for dst, src in pairs:
                dst.copy_(src)
            return
        jobs = []
        for dst, src in pairs:
            d, s = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
            for pos in range(0, d.numel(), _PIECE):
                jobs.append((d[pos:pos + _PIECE], s[pos:pos + _PIECE]))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="refckpt-stage")
        for fut in [self._pool.submit(d.copy_, s) for d, s in jobs]:
            fut.result()


def _dtensor_like(obj: Any, local: torch.Tensor) -> Any:
    """A DTensor over ``local`` (a host copy of ``obj``'s local shard: same shape, stride, dtype)
    with ``obj``'s mesh, placements, global shape and stride: ``obj``'s own spec, reused.
    ``DTensor.from_local`` builds the same through an autograd function and a new spec: 0.86 ms
    per tensor here against 1 us, and three quarters of a deferred save's time on the caller's
    path with FSDP2 (156 DTensors: 150 of 207 ms, profiled). Where this torch's constructor
    differs, ``from_local``."""
    from torch.distributed.tensor import DTensor

    spec = getattr(obj, "_spec", None)
    if spec is not None:
        try:
            # __new__ alone (C++: a tensor subclass over ``local`` with ``spec``): DTensor's __init__
            # only calls Tensor.__init__, through a dynamo-disabling wrapper that costs ~0.6 ms a call
            made = DTensor.__new__(DTensor, local, spec, requires_grad=False)
        except TypeError:  # pragma: no cover - a torch whose DTensor constructor takes other arguments
            made = None
        if made is not None and made._local_tensor is local and made._spec is spec:
            return made
    return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                              shape=obj.shape, stride=obj.stride())


_PENDING, _BACKGROUND, _CLAIMED, _DONE = range(4)  # a job's state (see the module docstring)


class _Job:
    """One tensor of a plan: where it is in the tree, its buffer, the tensor, its version at the call."""

    __slots__ = ("path", "dst", "src", "version", "wrapper", "wrapper_version", "state", "changed_at_copy")

    def __init__(self, path: tuple, dst: torch.Tensor, src: torch.Tensor, version: int) -> None:
        self.path, self.dst, self.src, self.version = path, dst, src, version
        #: a DTensor whose local shard ``src`` is, and its version at the call
        self.wrapper: torch.Tensor | None = None
        self.wrapper_version = -1
        #: _PENDING, _BACKGROUND (the background copier copies it), _CLAIMED (a forward copies it
        #: on its own thread) or _DONE; changed under the plan's lock only
        self.state = _PENDING
        #: a job a forward let through (it copied it, or found its copy done): whether it had changed
        #: then, before that forward ran (None: checked when the whole copy has ended)
        self.changed_at_copy: bool | None = None

    @property
    def changed(self) -> bool:
        return self.src._version != self.version or (
            self.wrapper is not None and self.wrapper._version != self.wrapper_version)

    @property
    def key(self) -> str:
        return ".".join(str(p) for p in self.path if p != "<local>")


class DeferredCopy:
    """A deferred snapshot (see the module docstring): made by :meth:`Stager.plan` on the caller's
    thread, copied by :meth:`copy` on the background thread, guarded by :meth:`install_guards`
    in between."""

    def __init__(self, stager: Stager, tree: Any, jobs: list[_Job], ready: dict[torch.device, Any]) -> None:
        self._stager = stager
        #: per device of the jobs: an event on the caller's current stream at the call (None: none
        #: could be recorded; the copy then synchronizes the whole device)
        self.ready = ready
        #: the state tree whose tensors are the host buffers (filled by :meth:`copy`).
        self.tree = tree
        self.jobs = jobs
        self._done = threading.Event()
        self._copier: int | None = None
        self._handles: list[Any] = []
        #: guards the jobs' states and :attr:`claimed`; notified whenever a job is done or the copy ends
        self._cond = threading.Condition(threading.Lock())
        self._claims_open = 0  # jobs claimed by a forward whose copy has not ended yet
        self._claim_error: BaseException | None = None
        #: storage address -> the jobs of the tensors in it (a state dict holds detached aliases)
        self._by_storage: dict[int, list[_Job]] = {}
        #: id(module) -> (module, the jobs of its subtree's buffers no forward has let through yet; empty
        #: once its forward did): the module is held so that its id is not reused while the entry lives
        #: (cleared when the copy ends)
        self._needs: dict[int, tuple[torch.nn.Module, tuple[_Job, ...]]] = {}
        #: the keys of the tensors a forward claimed and copied on its own thread, in that order
        #: (diagnostics; kept after the copy ends)
        self.claimed: list[str] = []

    @property
    def done(self) -> bool:
        """The copy has ended (copied and checked, or failed)."""
        return self._done.is_set()

    def copy(self) -> Any:
        """Copy every recorded tensor into its buffer (but those a forward claimed, whose copies it
        waits for), then check that none changed since the call (on the background thread); returns
        :attr:`tree` or raises :class:`~refckpt.errors.SnapshotChangedError`. Ends the guards'
        waiting either way."""
        self._copier = threading.get_ident()
        try:
            try:
                self._stager._copy(self)
            finally:  # a forward's claimed copies write into the buffers: never return before they end
                with self._cond:
                    self._cond.wait_for(lambda: self._claims_open == 0)
            if self._claim_error is not None:
                raise RuntimeError(f"deferred snapshot: a copy made by a forward on the training thread failed: "
                                   f"{type(self._claim_error).__name__}: {self._claim_error}") from self._claim_error
            with self._cond:  # no forward lets a job through (and then changes it) while its version is read
                changed = [j.key for j in self.jobs if (j.changed if j.changed_at_copy is None else j.changed_at_copy)]
            if changed:
                shown = ", ".join(repr(k) for k in changed[:5]) + (f" and {len(changed) - 5} more"
                                                                   if len(changed) > 5 else "")
                raise SnapshotChangedError(
                    f"deferred snapshot: {len(changed)} saved tensor(s) changed in place after save() returned "
                    f"and before the background copy ended, so this save is not written: {shown}. With "
                    f"snapshot='deferred', optimizer.step() waits for the copy and the forward of a module "
                    f"copies its subtree's buffers first; make any other in-place change to a saved tensor after "
                    f"maybe_wait_for_async_save(), or save with the default snapshot='copy' (then anything may "
                    f"change once save returns)"
                )
            return self.tree
        finally:
            self.end()

    def end(self) -> None:
        """Nothing waits for this copy any more (it ended, or will never run); hold no reference
        to the caller's tensors any more."""
        with self._cond:
            self._done.set()
            self.jobs, self.ready = [], {}
            self._by_storage, self._needs = {}, {}
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until the copy has ended (never on the copying thread itself)."""
        if not self._done.is_set() and threading.get_ident() != self._copier:
            self._done.wait()

    # -- the jobs' states (see the module docstring) -----------------------------------------------
    def _take(self, job: _Job) -> bool:
        """The background copier's claim: whether it copies ``job`` (not claimed by a forward)."""
        with self._cond:
            if job.state != _PENDING:
                return False
            job.state = _BACKGROUND
            return True

    def _finish(self, jobs: Any) -> None:
        """The background copier's copies of ``jobs`` have ended."""
        if jobs:
            with self._cond:
                for j in jobs:
                    j.state = _DONE
                self._cond.notify_all()

    def _claim_and_copy(self, jobs: tuple[_Job, ...]) -> list[_Job]:
        """On the caller's thread: claim the pending ``jobs`` and copy them here (a blocking copy, on
        the caller's current stream for a device tensor, after the event recorded at the call);
        return the others that are not done yet (being copied by the background or another caller)."""
        with self._cond:
            if self._done.is_set():
                return []
            mine = [j for j in jobs if j.state == _PENDING]
            for j in mine:
                j.state = _CLAIMED
            self._claims_open += len(mine)
            ready = self.ready
        try:
            for j in mine:
                src = j.src
                if src.device.type != "cpu":
                    ev = ready.get(src.device)
                    if ev is not None:
                        torch.accelerator.current_stream(src.device).wait_event(ev)
                j.dst.copy_(src)  # blocking: complete before the forward's kernels run
                j.changed_at_copy = j.changed
        except BaseException as e:  # fails the save (in copy), never the training step (but an interrupt)
            self._claim_error = e
            if not isinstance(e, Exception):
                raise
        finally:
            with self._cond:
                for j in mine:
                    j.state = _DONE
                self._claims_open -= len(mine)
                self.claimed.extend(j.key for j in mine)
                self._cond.notify_all()
                busy = [j for j in jobs if j.state != _DONE]
        return busy

    def _wait_for_jobs(self, jobs: list[_Job]) -> None:
        """On the caller's thread: block until ``jobs`` are done (or the copy has ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done.is_set() or all(j.state == _DONE for j in jobs))

    def _let_through(self, module: torch.nn.Module, jobs: tuple[_Job, ...]) -> None:
        """On the caller's thread, before ``module``'s forward runs: ``jobs`` are copied; check each
        one's version now (the forward may change it next, legitimately: BatchNorm's
        ``num_batches_tracked.add_(1)``, DDP's broadcast, which bumps the version for a while), and
        let this module's next forwards pass at the cost of a lookup."""
        with self._cond:
            if self._done.is_set():
                return
            for j in jobs:
                if j.changed_at_copy is None:
                    j.changed_at_copy = j.changed
            self._needs[id(module)] = (module, ())

    # -- the guards --------------------------------------------------------------------------
    def install_guards(self) -> None:
        """Global hooks that make mutations of a training loop wait for the copy: every
        ``optimizer.step`` waits for the whole copy; the forward of a module first copies (or
        waits for the copies of) the buffers of its subtree -- not its parameters, whose in-place
        changes fail the save instead (see the module docstring). Removed by :meth:`remove_guards`."""
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        if self._handles:
            return
        # a module's buffers are found by storage, not identity: a state dict holds detached aliases
        by_storage: dict[int, list[_Job]] = {}
        for j in self.jobs:
            ptr = _storage_of(j.src)
            if ptr:
                by_storage.setdefault(ptr, []).append(j)
        self._by_storage = by_storage
        self._handles = [register_optimizer_step_pre_hook(self._before_step),
                         register_module_forward_pre_hook(self._before_forward)]

    def remove_guards(self) -> None:
        """Remove the hooks; call on the training loop's thread, outside ``optimizer.step`` and
        forward (they iterate over the hooks)."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._done.is_set():
            return
        entry = self._needs.get(id(module))
        jobs = entry[1] if entry is not None and entry[0] is module else self._subtree_jobs(module)
        if not jobs or threading.get_ident() == self._copier:
            return
        busy = self._claim_and_copy(jobs)
        if busy:  # being copied right now, by the background copier or another caller
            self._wait_for_jobs(busy)
        self._let_through(module, jobs)

    def _subtree_jobs(self, module: torch.nn.Module, visiting: set[int] | None = None) -> tuple[_Job, ...]:
        """The jobs of the buffers registered in ``module`` and below it that no forward has let
        through yet (the union of its own and its children's, each computed once and cached)."""
        needs = self._needs
        entry = needs.get(id(module))
        if entry is not None and entry[0] is module:
            return entry[1]
        visiting = set() if visiting is None else visiting
        if id(module) in visiting:  # a module that (pathologically) contains itself
            return ()
        visiting.add(id(module))
        by_storage = self._by_storage
        found: dict[int, _Job] = {}
        buffers = getattr(module, "_buffers", None)
        for b in (buffers.values() if buffers else ()):
            if b is not None:
                for j in by_storage.get(_storage_of(b), ()):
                    found[id(j)] = j
        children = getattr(module, "_modules", None)
        for child in (children.values() if children else ()):
            if child is not None:
                for j in self._subtree_jobs(child, visiting):
                    found[id(j)] = j
        jobs = tuple(j for j in found.values() if j.changed_at_copy is None)
        needs[id(module)] = (module, jobs)
        return jobs


def _ready_events(jobs: list[_Job]) -> dict[torch.device, Any]:
    """Deferred: for each accelerator device of the jobs, an event recorded on the caller's current
    stream at the call. The background thread's copies wait for it (the background thread has its
    own current stream), so they read what every kernel queued before ``save()`` wrote, whatever
    stream the training loop runs on."""
    out: dict[torch.device, Any] = {}
    for j in jobs:
        dev = j.src.device
        if dev.type != "cpu" and dev not in out:
            try:
                out[dev] = torch.accelerator.current_stream(dev).record_event()
            except (AttributeError, RuntimeError, ValueError):  # pragma: no cover - no torch.accelerator stream API
                out[dev] = None
    return out


def _storage_of(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local shard's); 0 when it has none."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, some wrapper subclasses)
        return 0
