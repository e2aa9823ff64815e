"""Helpers the suite's tests share: examples per property, building checkpointers from their
declared capabilities (:mod:`faults.contract`), saving into step directories and resuming a
root the way a restarted job does, reading the on-disk contract, reporting advisories."""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import os
import pickle
import select
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

from faults.contract import POINTER_FILE, STEP_RE, Capability, Limitation, capabilities_of, limitations_of, step_dir_name
from faults.findings import advise
from faults.training import NOT_AN_EXCEPTION, RunConfig, TrainRun, _errors, describe_error, reference_digest


def budget(request, *, scale: float = 1.0, **kw) -> settings:
    """``--fault-budget`` examples (times ``scale``) per property. ``FAULTS_SUITE_NO_SHRINK=1``
    (mutation runs) skips shrinking -- a kill matrix only needs to know *that* a checkpointer
    fails -- and the example database."""
    mutation = bool(os.environ.get("FAULTS_SUITE_NO_SHRINK"))
    phases = [p for p in Phase if p is not Phase.shrink] if mutation else list(Phase)
    n = max(1, round(request.config.getoption("--fault-budget") * scale))
    # Mutation runs use no example database: a kill must come from the seed, the same on every
    # machine, not from failures an earlier local run happened to store. derandomize=False:
    # where CI=true or GITHUB_ACTIONS=true, Hypothesis loads its "ci" profile, which derandomizes
    # and so ignores --hypothesis-seed; the kill matrix then drew other examples in CI than on a
    # developer's machine (a mutant killed locally survived in CI).
    extra: dict[str, Any] = {"database": None, "derandomize": False} if mutation else {}
    return settings(max_examples=n, deadline=None, phases=phases, print_blob=True, **extra,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large], **kw)


class Stats:
    """Counts what a test exercised (examples, crashes, resumes...); ``faults.plugin`` prints
    the totals at the end of the run, so a green run says how much it actually tried."""

    def __init__(self, request) -> None:
        self.counts: dict[str, int] = {}
        request.node.user_properties.append(("faults-suite", self.counts))

    def add(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


_OPTION_CAPS = {"keep_last": Capability.KEEP_LAST, "overwrite": Capability.OVERWRITE,
                "extra_state_per_rank": Capability.EMBEDDED_EXTRA_STATE}
_CAPS: dict[int, frozenset[Capability]] = {}


def caps(factory) -> frozenset[Capability]:
    """What ``factory`` declares (:func:`faults.contract.capabilities_of`), asked once."""
    key = id(factory)
    if key not in _CAPS:
        _CAPS[key] = capabilities_of(factory)
    return _CAPS[key]


def has(factory, cap: Capability) -> bool:
    return cap in caps(factory)


_LIMS: dict[int, frozenset[Limitation]] = {}


def lacks(factory, lim: Limitation) -> bool:
    """Whether ``factory`` declares the :class:`~faults.contract.Limitation` ``lim``."""
    key = id(factory)
    if key not in _LIMS:
        _LIMS[key] = limitations_of(factory)
    return lim in _LIMS[key]


def need_not(factory, *lims: Limitation, what: str = "") -> None:
    """Skip the running test, saying which, when ``factory`` declares one of ``lims``."""
    found = [lim for lim in lims if lacks(factory, lim)]
    if found:
        pytest.skip(f"{what + ': ' if what else ''}checkpointer declares limitation "
                    + ", ".join(str(x) for x in found) + " (faults.contract.Limitation)")


def need_async(factory, save_async: bool = True) -> None:
    """Skip an async case of a test for a checkpointer that declares ``sync_only``."""
    if save_async:
        need_not(factory, Limitation.SYNC_ONLY, what="an async save")


def async_draws(factory):
    """The ``save_async`` values a property may draw: both, or only sync under ``sync_only``."""
    from hypothesis import strategies as st

    return st.just(False) if lacks(factory, Limitation.SYNC_ONLY) else st.booleans()


def shardings(factory) -> tuple[str, ...]:
    """The shardings a property may draw: no FSDP2 (DTensor) under ``plain_tensors_only``."""
    return ("replicated",) if lacks(factory, Limitation.PLAIN_TENSORS_ONLY) else ("replicated", "fsdp2")


def need(factory, *wanted: Capability) -> None:
    """Skip the running test, saying which, unless ``factory`` declares every capability."""
    missing = [c for c in wanted if c not in caps(factory)]
    if missing:
        pytest.skip("checkpointer does not declare capability " + ", ".join(str(c) for c in missing)
                    + " (faults.contract.Capability)")


def make(factory, **options: Any):
    """``factory(**options)``; an option whose capability the checkpointer does not declare skips
    the test, saying so, and so does a *value* it refuses when it is built (``ValueError``:
    torchtitan refuses ``keep_last=1``, it keeps at least 2), with the checkpointer's own reason.
    A declared option the factory does not take at all (``TypeError``) fails: the declaration is
    false, and skipping would hide every test of the capability (issue 29)."""
    need(factory, *(_OPTION_CAPS[k] for k in options))
    try:
        return factory(**options)
    except ValueError as e:
        pytest.skip(f"checkpointer refuses {options} when built: {type(e).__name__}: {e}")
    except TypeError as e:
        raise AssertionError(f"the checkpointer declares {', '.join(str(_OPTION_CAPS[k]) for k in options)}, and "
                             f"factory(**{options}) raised {type(e).__name__}: {e}") from e


def accepts(factory, **options: Any) -> bool:
    """Whether ``factory`` declares the options' capabilities and builds with these values
    (for draws: a value it refuses is never drawn)."""
    if any(_OPTION_CAPS[k] not in caps(factory) for k in options):
        return False
    try:
        ck = factory(**options)
    except ValueError:
        return False
    except TypeError as e:  # declared, and not taken at all: the declaration is false (see make)
        raise AssertionError(f"the checkpointer declares {', '.join(str(_OPTION_CAPS[k]) for k in options)}, and "
                             f"factory(**{options}) raised {type(e).__name__}: {e}") from e
    close = getattr(ck, "close", None)
    if callable(close):
        close()
    return True


#: The run the suite's single-configuration tests train (a frozen dataclass: safe to share).
DEFAULT_CONFIG = RunConfig()


def config_for(factory, cfg: RunConfig = DEFAULT_CONFIG) -> RunConfig:
    """``cfg`` with rank-invariant extra state unless per-rank extra state is declared."""
    if cfg.extra_per_rank and not has(factory, Capability.PER_RANK_EXTRA_STATE):
        return dataclasses.replace(cfg, extra_per_rank=False)
    return cfg


def step_path(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), step_dir_name(step))


def same_path(a: str | None, b: str | None) -> bool:
    """Two spellings of one step directory (a checkpointer may return it relative or with a
    trailing slash); None only equals None."""
    if a is None or b is None:
        return a is b
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


class Completeness:
    """Whether step ``N`` under a root is *complete*, asked of the checkpointer itself: a copy of
    ``global_step_N`` (links, FIFOs and devices recreated as they are, never followed) alone in a
    scratch root, beside a pointer naming it (the most favourable hint), and
    ``find_latest_checkpoint`` of that root must return it. So a verdict ("acknowledged save lost",
    "the newest complete step is N") never rests on a file name such as ``.metadata``: a
    checkpointer that writes no commit record is judged by what it does, and one that writes a
    record but ignores it is judged the same way. ``resume`` then checks that what it calls
    complete loads bitwise, so an oracle that says "complete" too easily is caught there. A
    checkpointer that finds its step through a pointer of its own (DeepSpeed's ``latest``) is asked
    a second time with the root's small top-level files copied beside the step, rewritten to name it.

    One checkpointer (``factory(**options)``) is made on first use; answers are cached per
    fingerprint of the step's tree (names, kinds, sizes, mtimes, inodes). ``why(root, step)``
    says what the last "no" was (``find_latest_checkpoint`` returned something else, or raised)."""

    def __init__(self, factory, **options: Any) -> None:
        self._factory, self._options = factory, options
        self._ck: Any = None
        self._cache: dict[tuple, tuple[bool, str]] = {}

    def __call__(self, root: str, step: int) -> bool:
        return self.judge(root, step)[0]

    def why(self, root: str, step: int) -> str:
        return self.judge(root, step)[1]

    def judge(self, root: str, step: int) -> tuple[bool, str]:
        src = step_path(root, step)
        fp = _fingerprint(src)
        if fp is None:
            return False, f"{step_dir_name(step)} is not on disk"
        key = (step, fp)
        if key not in self._cache:
            self._cache[key] = self._ask(src, step)
        return self._cache[key]

    def _ask(self, src: str, step: int) -> tuple[bool, str]:
        scratch = tempfile.mkdtemp(prefix="faults-complete-")
        try:
            dst = step_path(scratch, step)
            from faults.errors import harness

            with harness("faults.suite._common.Completeness (copying the step)"):
                _copy_tree(src, dst)
            with open(os.path.join(scratch, POINTER_FILE), "w") as f:
                f.write(f"{step}\n")
            if self._ck is None:
                self._ck = self._factory(**self._options)
            try:
                got = self._ck.find_latest_checkpoint(scratch)
            except _errors() as e:  # noqa: BLE001 - a "no", with the reason
                return False, (f"find_latest_checkpoint of a root holding only {step_dir_name(step)} raised "
                               f"{describe_error(e)}")
            if same_path(got, dst):
                return True, ""
            # A checkpointer that finds steps through a pointer of its own (DeepSpeed's ``latest``)
            # is asked again with the root's own top-level files beside the copy, each naming this step.
            if self._with_own_pointers(os.path.dirname(src), scratch, step):
                try:
                    again = self._ck.find_latest_checkpoint(scratch)
                except _errors():  # noqa: BLE001 - the first answer stands
                    again = None
                if same_path(again, dst):
                    return True, ""
            return False, (f"find_latest_checkpoint of a root holding only a copy of {step_dir_name(step)} (and a "
                           f"pointer naming it) returned {got!r}: the checkpointer itself does not take it as complete")
        finally:
            _remove_tree(scratch)

    @staticmethod
    def _with_own_pointers(root: str, scratch: str, step: int) -> bool:
        """Copy ``root``'s top-level regular files (small ones: pointers, not payloads) into
        ``scratch``, each with every step name in it (``global_step_M``) and a whole content that is
        a step number rewritten to name ``step``. False when the root has no such file."""
        import re

        copied = False
        try:
            names = os.listdir(root)
        except OSError:
            return False
        for name in names:
            src = os.path.join(root, name)
            if name == POINTER_FILE or STEP_RE.match(name) or not _is_small_regular(src):
                continue
            try:
                with open(src, "rb") as f:
                    data = f.read(_OWN_POINTER_MAX + 1)
            except OSError:
                continue
            text = data.decode("utf-8", "replace")
            text = re.sub(r"global_step_-?\d+", step_dir_name(step), text)
            if text.strip().lstrip("-").isdigit():
                text = f"{step}\n"
            with open(os.path.join(scratch, name), "w") as f:
                f.write(text)
            copied = True
        return copied


#: The largest top-level file :class:`Completeness` copies as a checkpointer's own pointer.
_OWN_POINTER_MAX = 4096


def _is_small_regular(path: str) -> bool:
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size <= _OWN_POINTER_MAX


def _fingerprint(path: str) -> tuple | None:
    try:
        st0 = os.lstat(path)
    except OSError:
        return None
    out: list[tuple] = [("", st0.st_mode, st0.st_ino)]
    for dirpath, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out.append((os.path.relpath(p, path), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _copy_tree(src: str, dst: str) -> None:
    """Copy a step as it is: regular files' bytes, links as links, FIFOs and devices recreated
    (never opened: a FIFO would block the copy)."""
    import shutil
    import stat

    st0 = os.lstat(src)
    if stat.S_ISLNK(st0.st_mode):
        os.symlink(os.readlink(src), dst)
        return
    os.mkdir(dst)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        st = os.lstat(s)
        if stat.S_ISDIR(st.st_mode):
            _copy_tree(s, d)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(s), d)
        elif stat.S_ISREG(st.st_mode):
            shutil.copy2(s, d)
        elif stat.S_ISFIFO(st.st_mode):
            os.mkfifo(d)
        else:
            try:
                os.mknod(d, st.st_mode, st.st_rdev)
            except OSError:
                pass


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def read_pointer(root: str) -> bytes | None:
    try:
        with open(os.path.join(root, POINTER_FILE), "rb") as f:
            return f.read()
    except OSError:
        return None


def save_step(ck, root: str, run: TrainRun, *, save_async: bool = False, wait: bool = True) -> None:
    """``save`` of the run's current step into its step directory (the contract's ``path``)."""
    ck.save(step_path(root, run.step), run.state(), global_step=run.step, save_async=save_async)
    if wait:
        ck.maybe_wait_for_async_save()


def save_steps(ck, root: str, cfg: RunConfig, steps, save_async: bool = False) -> TrainRun:
    run = TrainRun(cfg)
    for s in steps:
        run.train_to(s)
        save_step(ck, root, run, save_async=save_async)
    return run


def load_into(ck, path: str, run: TrainRun, *, unprimed: bool = False) -> None:
    """Load ``path`` into a fresh ``run`` as the contract's caller does: the optimizer primed by
    the caller (``unprimed`` leaves it empty, for checkpointers that declare priming), extra
    state asked for with a skeleton; then apply."""
    state = run.state(unprimed=unprimed, target=True)
    skeleton = state.pop("extra_state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ck.load(path, state, extra_state_skeleton=skeleton)
    if isinstance(out, dict):
        state = out
    if "extra_state" not in state:
        raise AssertionError(f"load({path!r}, extra_state_skeleton=...) did not restore state['extra_state']")
    got = state["extra_state"]
    missing = [k for k in skeleton if not isinstance(got, dict) or k not in got]
    if missing:
        raise IncompleteState(f"load({path!r}) returned without an error, but the extra state it restored lacks "
                              f"{missing[:8]} (a silently incomplete state)")
    run.apply(state)


class IncompleteState(AssertionError):
    """``load`` returned without an error, and the state it filled lacks what was saved."""


class ResumeFailed(AssertionError):
    """A restarted job could not resume: which call raised, on which step, and why. ``cause``
    is the checkpointer's own error."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def resume(ck, root: str, cfg: RunConfig, *, unprimed: bool = False) -> tuple[str | None, TrainRun]:
    """A restarted job: fresh objects, ``find_latest_checkpoint``, ``load``, apply. A
    checkpointer error becomes :class:`ResumeFailed`, naming the call and the step."""
    run = TrainRun(cfg)
    try:
        path = ck.find_latest_checkpoint(root)
    except _errors() as e:  # noqa: BLE001 - reported with what raised it
        raise ResumeFailed(f"resume failed: find_latest_checkpoint({root}) raised {describe_error(e)}", e) from e
    if path is not None:
        try:
            load_into(ck, path, run, unprimed=unprimed)
        except _errors() as e:  # noqa: BLE001
            if isinstance(e, AssertionError):
                raise
            raise ResumeFailed(f"resume failed: find_latest_checkpoint chose {path}, and load raised "
                               f"{describe_error(e)} (a restarted job stops here, although a step before it "
                               "may be intact)", e) from e
    return (None if path is None else str(path)), run


def assert_resumed(path: str | None, run: TrainRun, root: str, want: int | None, cfg: RunConfig, what: str = "") -> None:
    want_path = None if want is None else step_path(root, want)
    assert same_path(path, want_path), f"{what}resumed {path}, the newest complete checkpoint is {want_path}"
    if want is not None:
        assert run.step == want, f"{what}extra_state global_step {run.step}, saved at {want}"
        assert run.digest() == reference_digest(cfg, want), (
            f"{what}state restored from step {want} differs from an uninterrupted run at step {want}")


def refused(e: BaseException, what: str) -> BaseException:
    """An error the checkpointer raised where raising is right (a refused save, a failed async
    save): fine, but one that is not an ``Exception`` is a hardening advisory -- a trainer's
    ``except Exception`` lets it through."""
    if not isinstance(e, Exception):
        advise(f"{what} raised {type(e).__module__}.{type(e).__name__}, which is not an Exception subclass: "
               f"a trainer's `except Exception` does not catch it")
    return e


def refused_in_rank(errors, what: str) -> None:
    """:func:`refused` for the error strings rank functions return (``faults.training._error``)."""
    for e in errors:
        if isinstance(e, str) and e.startswith(NOT_AN_EXCEPTION):
            advise(f"{what} raised {e[len(NOT_AN_EXCEPTION):].split(':', 1)[0]}, which is not an Exception "
                   f"subclass: a trainer's `except Exception` does not catch it")


def in_child(fn: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """``fn()`` in a forked child; returns its (picklable) result.

    For calls that a fault may hang (a FIFO opened for reading), crash (a recursion too deep
    for the C stack) or exhaust: the test fails naming ``what`` -- never hangs or dies with
    it. A hang past ``timeout`` seconds SIGKILLs the child, and the failure shows the Python
    stack of every thread of the child at that moment (faulthandler), so it names the call
    that hung; an exception in ``fn`` fails with its traceback. No threads of this process are running when the suite forks (its
    checkpointers are made fresh and have not saved yet), so the child is safe to run. The
    child freezes what it inherited (``gc.freeze()``) before anything else: the parent's
    uncollected garbage can hold objects whose finalizers wait on threads that fork did not
    copy (a process group's), and a collection in the child then hung it (seen once, in
    ``torch.load``, under ``pytest -n 8``)."""
    r, w = os.pipe()
    stacks = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            gc.freeze()  # what the child inherited is the parent's to collect (see above)
            os.close(r)
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
            try:
                out = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = ("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            try:
                data = pickle.dumps(out)
            except Exception as e:  # noqa: BLE001
                data = pickle.dumps(("raised", f"unpicklable result: {e}"))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise AssertionError(f"{what}: no answer within {timeout:.0f} s (hung; killed). Python stack of "
                                     f"every thread at the timeout:\n{_stacks_then_kill(pid, stacks)}")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        stacks.close()
    status = os.waitpid(pid, 0)[1]
    if not chunks:
        code = os.waitstatus_to_exitcode(status)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise AssertionError(f"{what}: the process died ({how}) without an answer")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "raised":
        raise AssertionError(f"{what}: raised {value}")
    return value


def _stacks_then_kill(pid: int, stacks) -> str:
    """Ask the hung child for its stacks (SIGUSR1: faulthandler writes them from a C signal
    handler, even while the child blocks in a system call), then SIGKILL it and reap it."""
    try:
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5.0
        size = -1
        while time.monotonic() < deadline:  # until the dump stops growing
            time.sleep(0.1)
            now = os.fstat(stacks.fileno()).st_size
            if now and now == size:
                break
            size = now
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    stacks.seek(0)
    return stacks.read().decode("utf-8", "replace")[-6000:] or "(no stack: the child did not answer SIGUSR1)"
