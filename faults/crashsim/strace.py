"""The recorder that needs no cooperation from the checkpointer: its save under ``strace -f``,
parsed into the :class:`~faults.crashsim.model.FOp` trace the power-loss explorer replays."""

from __future__ import annotations

import os

from .model import FOp

__all__ = ["strace_record", "parse_strace"]


_STRACE_CALLS = ("openat,open,creat,write,pwrite64,lseek,ftruncate,fsync,fdatasync,rename,renameat,renameat2,"
                 "unlink,unlinkat,mkdir,mkdirat,rmdir,close")


def strace_record(argv: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float = 600) -> list[FOp]:
    """Run ``argv`` under ``strace -f`` and return its file-system operations: the recorder that
    needs no cooperation from the checkpointer. Single-process savers (threads included):
    descriptors are tracked per traced process group as one table."""
    import glob
    import shutil as _sh
    import subprocess
    import tempfile

    if _sh.which("strace") is None:
        raise RuntimeError("strace is not installed (apt-get install strace); use recording_io() for refckpt")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace")
        cmd = ["strace", "-f", "-ff", "-qq", "--seccomp-bpf", "-ttt", "-xx", "-s", str(1 << 24), "-e", f"trace={_STRACE_CALLS}",
               "-o", out] + list(argv)
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"traced command failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        lines = []
        for path in glob.glob(out + ".*"):
            with open(path, errors="replace") as f:
                lines += [ln for ln in f if ln.strip()]
    return parse_strace(lines, cwd or os.getcwd())


def _unhex(s: str) -> bytes:
    """strace ``-xx`` string literal (every byte as \\xNN) to bytes."""
    out = bytearray()
    i = 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) + 1 and s[i + 1] == "x":
            out.append(int(s[i + 2:i + 4], 16))
            i += 4
        else:  # pragma: no cover - -xx escapes every byte
            out += s[i].encode()
            i += 1
    return bytes(out)


def _args(text: str) -> list[str]:
    """Split a syscall's argument list at top-level commas (strings and brackets kept whole)."""
    out, cur, depth, in_str = [], [], 0, False
    i = 0
    while i < len(text):
        c = text[i]
        if in_str:
            cur.append(c)
            if c == "\\":
                cur.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            cur.append(c)
        elif c in "[{(":
            depth += 1
            cur.append(c)
        elif c in "]})":
            depth -= 1
            cur.append(c)
        elif c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur).strip())
    return out


def parse_strace(lines: list[str], cwd: str) -> list[FOp]:
    """strace ``-ttt -xx`` lines (``TIMESTAMP call(args) = ret``) to :class:`FOp`, in time order."""
    import re

    pat = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\) += (-?\d+|0x[0-9a-f]+)")
    calls = []
    for ln in lines:
        m = pat.match(ln.strip())
        if m and not m.group(4).startswith("-"):
            calls.append((float(m.group(1)), m.group(2), _args(m.group(3)), int(m.group(4), 0)))
    calls.sort(key=lambda c: c[0])
    fdpath: dict[int, str] = {}
    pos: dict[int, int] = {}
    handle: dict[int, int] = {}
    nxt = iter(range(1, 1 << 30))
    ops: list[FOp] = []

    def s(arg: str) -> str:
        return _unhex(arg[1:-1]).decode("utf-8", "surrogateescape") if arg.startswith('"') else arg

    def at(dirfd: str, path: str) -> str:
        if os.path.isabs(path):
            return os.path.normpath(path)
        base = cwd if dirfd == "AT_FDCWD" else fdpath.get(int(dirfd), cwd)
        return os.path.normpath(os.path.join(base, path))

    for t, name, a, ret in calls:
        ts = int(t * 1e9)
        if name in ("openat", "open", "creat"):
            dirfd, path, flags = ("AT_FDCWD", s(a[0]), a[1] if len(a) > 1 else "") if name != "openat" else (a[0], s(a[1]), a[2])
            if name == "creat":
                flags = "O_CREAT|O_TRUNC|O_WRONLY"
            full = at(dirfd, path)
            fdpath[ret], pos[ret] = full, 0
            handle[ret] = next(nxt)
            writing = "O_WRONLY" in flags or "O_RDWR" in flags
            if writing or "O_CREAT" in flags:
                ops.append(FOp(ts, "open", full, fd=handle[ret], create="O_CREAT" in flags, trunc="O_TRUNC" in flags))
            else:
                ops.append(FOp(ts, "open", full, fd=handle[ret]))
        elif name in ("write", "pwrite64"):
            fd = int(a[0])
            data = _unhex(a[1][1:-1])[:ret]
            off = int(a[3]) if name == "pwrite64" else pos.get(fd, 0)
            if name == "write":
                pos[fd] = off + ret
            if fd in handle:
                ops.append(FOp(ts, "write", fdpath.get(fd, ""), fd=handle[fd], offset=off, data=data))
        elif name == "lseek":
            pos[int(a[0])] = ret
        elif name == "ftruncate":
            fd = int(a[0])
            if fd in handle:
                ops.append(FOp(ts, "truncate", fdpath.get(fd, ""), fd=handle[fd], size=int(a[1])))
        elif name in ("fsync", "fdatasync"):
            fd = int(a[0])
            if fd in handle:
                ops.append(FOp(ts, "fsync", fdpath.get(fd, ""), fd=handle[fd]))
        elif name == "close":
            fd = int(a[0])
            fdpath.pop(fd, None), pos.pop(fd, None), handle.pop(fd, None)
        elif name in ("rename", "renameat", "renameat2"):
            if name == "rename":
                src, dst, flags = at("AT_FDCWD", s(a[0])), at("AT_FDCWD", s(a[1])), ""
            else:
                src, dst = at(a[0], s(a[1])), at(a[2], s(a[3]))
                flags = a[4] if len(a) > 4 else ""
            ops.append(FOp(ts, "exchange" if "RENAME_EXCHANGE" in flags else "rename", src, dst))
        elif name in ("unlink", "unlinkat", "rmdir"):
            if name == "unlinkat":
                ops.append(FOp(ts, "rmdir" if "AT_REMOVEDIR" in a[2] else "unlink", at(a[0], s(a[1]))))
            else:
                ops.append(FOp(ts, "rmdir" if name == "rmdir" else "unlink", at("AT_FDCWD", s(a[0]))))
        elif name in ("mkdir", "mkdirat"):
            path = at(a[0], s(a[1])) if name == "mkdirat" else at("AT_FDCWD", s(a[0]))
            ops.append(FOp(ts, "mkdir", path))
    return ops
