"""A checkpoint root shared by processes that do not know each other, as jobs on several hosts have
it: a reader in another pid namespace (another host's view of pids) paused inside its load while a
writer with retention runs, interrupted saves of many steps, and two writers of different steps.

The scripts run any checkpointer (``package.module:factory``) in a fresh ``python -c``; the
``*_problems`` functions judge what happened, by behaviour (what ``find_latest_checkpoint`` and
``load`` answer, what the state holds, how many bytes the root holds), never by a layout. Used by
``faults.suite`` (tests/test_shared_root.py there).

Time on the file system is moved, not waited for: a holder that stopped renewing is simulated by
moving the mtime of every file its process created in the root into the file system's past
(:func:`age_files`) by :data:`MAX_PIN_S`: a dead reader that still pins its step after that pins it
forever, for any expiry a checkpointer could reasonably choose.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import textwrap
from typing import Any

__all__ = ["MAX_PIN_S", "READER_SCRIPT", "SAVES_SCRIPT", "STOPPED_SAVE_SCRIPT", "unshare_argv", "start",
           "age_files", "leftover_bytes", "saves_problems"]

#: File-system seconds after which a dead reader's (or writer's) hold must be gone.
MAX_PIN_S = 2 * 3600

PRELUDE = textwrap.dedent('''
    import json, os, pickle, signal, stat, sys, warnings
    warnings.simplefilter("ignore")
    from faults import training as T

    spec, root = sys.argv[1], sys.argv[2]
    cfg, options = pickle.loads(bytes.fromhex(sys.argv[3])), json.loads(sys.argv[4])
    ck = T.load_factory(spec)(**options)
    run = T.TrainRun(cfg)

    def step_dir(step):
        return os.path.join(root, f"global_step_{step}")
''')

#: argv[5]: the step to read; argv[6]: "load" or "load_latest"; argv[7]: "step" pauses at the load's
#: first open of a file inside the step directory, "root" at its first open of anything under the root
#: (before it has read the step it will choose): an audit hook prints "paused PATH" and waits for a
#: line on stdin.
READER_SCRIPT = PRELUDE + textwrap.dedent('''
    step, mode, scope = int(sys.argv[5]), sys.argv[6], sys.argv[7]
    inside = os.path.realpath(step_dir(step) if scope == "step" else root) + os.sep
    paused = []

    def hook(event, args):
        if event != "open" or paused or not args or not isinstance(args[0], (str, bytes)):
            return
        p = os.path.realpath(os.fsdecode(args[0]))
        if p.startswith(inside):
            paused.append(p)
            print("paused " + p, flush=True)
            sys.stdin.readline()

    state = run.state(target=True)
    skeleton = state.pop("extra_state")
    sys.addaudithook(hook)
    try:
        if mode == "load_latest":
            path = ck.load_latest(root, state, extra_state_skeleton=skeleton)
        else:
            out = ck.load(step_dir(step), state, extra_state_skeleton=skeleton)
            state, path = (out if isinstance(out, dict) else state), step_dir(step)
        if path is not None:
            run.apply(state)
        result = {"path": None if path is None else str(path), "step": run.step, "digest": run.digest()}
    except T._errors() as e:  # Exception, and DCP's CheckpointException (a BaseException)
        result = {"raised": T.describe_error(e)}
    if not paused:
        print("never-paused", flush=True)
    print("result " + json.dumps(result), flush=True)
''')

#: argv[5]: JSON list of steps to save, in order; prints "ok N" or "failed N: error" for each.
SAVES_SCRIPT = PRELUDE + textwrap.dedent('''
    for step in json.loads(sys.argv[5]):
        run.train_to(step)
        try:
            ck.save(step_dir(step), run.state(), global_step=step)
            ck.maybe_wait_for_async_save()
            print(f"ok {step}", flush=True)
        except T._errors() as e:
            lines = [ln.strip() for ln in T.describe_error(e).splitlines() if ln.strip()]
            why = lines[0][:200] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")
            print(f"failed {step}: {why}", flush=True)
''')

#: argv[5]: the step; argv[6]: bytes; argv[7]: "kill" or "pause". Once the bulk of its payload is on
#: disk -- at its first fsync of a regular file holding at least that many bytes, or, for a
#: checkpointer that does not fsync, at its first rename once the root holds that many new bytes --
#: the save is SIGKILLed, or pauses (prints "paused", waits for a line on stdin, then goes on and
#: prints "ok N" or "failed N: error"); prints "completed" when neither point came.
#: "pause-root-rename" pauses instead at its first rename of a regular file that lies directly in
#: the root (a pointer written through a tmp file), whatever was written before.
STOPPED_SAVE_SCRIPT = PRELUDE + textwrap.dedent('''
    step, min_bytes, action = int(sys.argv[5]), max(1, int(sys.argv[6])), sys.argv[7]
    run.train_to(step)
    before = set(os.listdir(root))
    real = {n: getattr(os, n) for n in ("fsync", "rename", "replace")}
    stopped = []

    from faults.sharedroot import tree_bytes

    def new_bytes():
        return sum(tree_bytes(os.path.join(root, name)) for name in set(os.listdir(root)) - before)

    def stop():
        if stopped:
            return
        stopped.append(True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("paused", flush=True)
        sys.stdin.readline()

    at_root_rename = action == "pause-root-rename"

    def fsync(fd):
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if not at_root_rename and st is not None and stat.S_ISREG(st.st_mode) and st.st_size >= min_bytes:
            stop()
        return real["fsync"](fd)

    def in_root_file(src):
        try:
            src = os.path.realpath(os.fsdecode(src))
            return os.path.dirname(src) == os.path.realpath(root) and stat.S_ISREG(os.lstat(src).st_mode)
        except (OSError, TypeError):
            return False

    def renamer(name):
        def inner(*a, **k):
            if not stopped and (in_root_file(a[0]) if at_root_rename else new_bytes() >= min_bytes):
                stop()
            return real[name](*a, **k)
        return inner

    os.fsync, os.rename, os.replace = fsync, renamer("rename"), renamer("replace")
    try:
        ck.save(step_dir(step), run.state(), global_step=step)
        ck.maybe_wait_for_async_save()
        print(f"ok {step}" if stopped else "completed", flush=True)
    except T._errors() as e:
        lines = [ln.strip() for ln in T.describe_error(e).splitlines() if ln.strip()]
        print(f"failed {step}: " + lines[0][:200] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else ""), flush=True)
''')


def unshare_argv() -> list[str] | None:
    """The command prefix that runs a process in a pid namespace of its own (another host's view of
    pids), or None where this machine refuses one (not root, no unshare, a sandbox)."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if shutil.which("unshare") is None:
        return None
    try:
        p = subprocess.run(argv + ["true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return argv if p.returncode == 0 else None


def start(body: str, spec: str, root: str, cfg: Any, options: dict, *extra: str,
          prefix: list[str] | None = None) -> subprocess.Popen:
    """Start ``body`` in a fresh interpreter (under ``prefix``, e.g. :func:`unshare_argv`)."""
    argv = [*(prefix or []), sys.executable, "-c", body, spec, root, pickle.dumps(cfg).hex(),
            json.dumps(options), *extra]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=os.getcwd())


def fs_now(root: str) -> float:
    """The file system's clock: the mtime of a file created in ``root`` just now."""
    probe = os.path.join(root, f".faults-clock-{secrets.token_hex(6)}")
    with open(probe, "w"):
        pass
    try:
        return os.stat(probe).st_mtime
    finally:
        os.unlink(probe)


def age_files(root: str, names: set[str], seconds: float = MAX_PIN_S) -> list[str]:
    """Move the mtime of every file and directory in ``names`` (directly in ``root``, and everything
    under the directories) ``seconds`` into the file system's past. Returns the names aged."""
    now = fs_now(root)
    aged = []
    for name in sorted(names):
        path = os.path.join(root, name)
        if not os.path.lexists(path):
            continue
        todo = [path]
        if os.path.isdir(path) and not os.path.islink(path):
            todo += [os.path.join(d, n) for d, ds, fs in os.walk(path) for n in ds + fs]
        for p in todo:
            try:
                os.utime(p, (now - seconds, now - seconds), follow_symlinks=False)
            except OSError:
                pass
        aged.append(name)
    return aged


def tree_bytes(path: str) -> int:
    if os.path.islink(path) or not os.path.isdir(path):
        try:
            return os.lstat(path).st_size
        except OSError:
            return 0
    total = 0
    for d, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def leftover_bytes(root: str, keep: set[str]) -> dict[str, int]:
    """Bytes of every entry of ``root`` not named in ``keep`` (the steps that should be there, the
    pointer), by name."""
    out = {}
    for name in os.listdir(root):
        if name not in keep:
            out[name] = tree_bytes(os.path.join(root, name))
    return out


def saves_problems(outputs: list[str]) -> list[str]:
    """Every save a :data:`SAVES_SCRIPT` reported as failed."""
    return [ln for out in outputs for ln in out.splitlines() if ln.startswith("failed ")]
