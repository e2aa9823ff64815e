"""What the benchmark reads off the system: peak memory, the page cache, file systems, the machine."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import threading
import time
from typing import Any


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak RSS increase of this process over the RSS at :meth:`start`, in bytes.

    ``/proc/self/status`` ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, or a
    thread sampling ``VmRSS`` every millisecond where that is not permitted."""

    method: str | None = None  # decided once per process

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._max = 0
        self.base = 0

    @classmethod
    def _reset_hwm(cls) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> PeakRSS:
        if PeakRSS.method is None:
            hwm = self._reset_hwm() and _status_kib("VmHWM")
            PeakRSS.method = "VmHWM after clear_refs=5" if hwm else "VmRSS sampled every 1 ms"
        self.base = (_status_kib("VmRSS") or 0) * 1024
        if PeakRSS.method.startswith("VmHWM"):
            self._reset_hwm()
        else:
            self._max = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-rss")
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._max = max(self._max, (_status_kib("VmRSS") or 0) * 1024)

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = max(self._max, (_status_kib("VmRSS") or 0) * 1024)
        else:
            peak = (_status_kib("VmHWM") or 0) * 1024
        return max(0, peak - self.base)


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def resident_bytes(path: str) -> int | None:
    """Bytes of ``path`` in the page cache (``mincore``), or None where that cannot be asked."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    try:
        libc = _c()
    except (OSError, AttributeError):  # pragma: no cover - non-glibc
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return (n - bytes(vec).count(0)) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out: list[str] = []
    for d, _dirs, names in os.walk(path):
        out.extend(os.path.join(d, n) for n in names)
    return out


def du(path: str) -> int:
    return sum(os.path.getsize(fp) for fp in files_under(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str, how: str) -> tuple[str, int, int]:
    """Drop the page cache of every file under ``path``; returns (method used, bytes, bytes still resident).

    ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file after an fdatasync (DONTNEED
    leaves dirty pages alone); ``global``: ``echo 1 > /proc/sys/vm/drop_caches`` (root only; it
    drops every process's cache, falls back to ``fadvise`` where not permitted); ``none``."""
    files = files_under(path)
    used = how
    if how == "global":
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        except OSError:
            used = "fadvise"
    if used == "fadvise":
        if not hasattr(os, "posix_fadvise"):  # pragma: no cover - non-Linux
            used = "none"
        for fp in files if used == "fadvise" else ():
            fd = os.open(fp, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    total = sum(os.path.getsize(fp) for fp in files)
    resident = 0
    for fp in files:
        r = resident_bytes(fp)
        resident += 0 if r is None else r
    return used, total, resident


def fs_of(path: str) -> str:
    """The file system ``path`` is on: ``type (device on mount point)``."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:  # pragma: no cover - non-Linux
        pass
    return f"{best[1]} ({best[2]} on {best[0]})"


def machine() -> dict[str, Any]:
    import torch

    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    try:
        import safetensors

        st_version = safetensors.__version__
    except ImportError:
        st_version = None
    return {
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": st_version,
        "uid": os.getuid(),
    }


def dirty_kib() -> dict[str, int]:
    """System-wide ``Dirty`` and ``Writeback`` of ``/proc/meminfo``, in KiB (empty where not readable)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key = line.split(b":", 1)[0]
                if key in (b"Dirty", b"Writeback"):
                    out[key.decode()] = int(line.split()[1])
    except OSError:  # pragma: no cover - non-Linux
        pass
    return out


def settle_dirty(limit_kib: int = 1024, timeout: float = 2.0) -> dict[str, float]:
    """``os.sync()``, then wait (at most ``timeout`` s) until ``Dirty + Writeback`` is below
    ``limit_kib``: write-back of earlier operations (this process's or other jobs') is not billed
    to the next timed operation. Returns what was seen before and after, and the seconds waited."""
    before = dirty_kib()
    t0 = time.perf_counter()
    os.sync()
    after = dirty_kib()
    while sum(after.values()) >= limit_kib and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)
        after = dirty_kib()
    return {"dirty_before_kib": before.get("Dirty", 0), "writeback_before_kib": before.get("Writeback", 0),
            "dirty_kib": after.get("Dirty", 0), "writeback_kib": after.get("Writeback", 0),
            "settle_s": time.perf_counter() - t0}


def thread_sched() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far
    (``/proc/thread-self/schedstat``), or None where not available."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            on_cpu, wait = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):  # pragma: no cover - non-Linux, or schedstats off
        return None


class GcWatch:
    """Seconds the cyclic garbage collector ran, and how many full (generation 2) collections,
    while installed (``gc.callbacks``; collections on any thread)."""

    def __init__(self) -> None:
        self.s = 0.0
        self.full = 0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.s += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)


class SchedClock:
    """Where the calling thread's wall time went during an operation: on a CPU, waiting for a CPU
    (other jobs' load), or off the run queue (I/O, fsync, waiting for helper threads or other
    ranks); the whole process's CPU seconds (every thread, finished ones included); and the
    garbage collector's seconds and full collections."""

    def __init__(self) -> None:
        self.gc = GcWatch().__enter__()
        self.t0 = time.perf_counter()
        self.s0 = thread_sched()
        self.r0 = _rusage_cpu()

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        s1 = thread_sched()
        self.gc.__exit__()
        out = {"proc_cpu_s": _rusage_cpu() - self.r0, "gc_s": self.gc.s, "gc_full": self.gc.full}
        if self.s0 is not None and s1 is not None:
            on_cpu, wait = s1[0] - self.s0[0], s1[1] - self.s0[1]
            out |= {"cpu_s": on_cpu, "runq_s": wait, "blocked_s": max(0.0, wall - on_cpu - wait)}
        return out


def _rusage_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prefault(nbytes: int) -> float:
    """Touch ``nbytes`` of fresh memory and free it again; returns the seconds it took.

    Before a timed write: on a VM that hands freed guest memory back to the host (virtio-balloon
    free page reporting), the first touch of such a page faults on the host, and a write into new
    page-cache pages pays that inside ``write()``; memory touched and freed just before is handed
    out again first (reported pages go to the tail of the free lists)."""
    import torch

    t0 = time.perf_counter()
    if nbytes > 0:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.fill_(0)
        del buf
    return time.perf_counter() - t0
