"""``python -m benchmarks --probe-swing``: what makes the sync save's ratio to the raw write swing.

One process (world size 1), both state mixes, ``--repeats`` rounds; in each round every
operation below runs once, in an order rotated by one per round, into a fresh directory removed
afterwards. For every operation it records the wall time and where the calling thread's time
went (:class:`benchmarks.probes.SchedClock`: on a CPU, *waiting for a CPU* because other jobs
hold them, or blocked: I/O, fsync, waiting for helper threads), the process's CPU seconds, and the
system's ``Dirty`` / ``Writeback`` right before it; for refckpt's save also the seconds inside
each kind of file operation (through a timing :class:`refckpt.FileIO`).

The operations separate the candidate causes:

* ``raw_write``: the benchmark's ceiling: the state's bytes in 64 MiB writes to one new file,
  fsync of file and directory, after ``os.sync()`` (the benchmark's own settle);
* ``raw_write_nosettle``: the same right after the previous operation's files were deleted,
  without ``os.sync()``: does write-back left by earlier operations slow the next one?
* ``raw_write_per_tensor``: one write per tensor (16 MiB pieces), as refckpt's shard writer
  writes: hundreds of small writes for the transformer mix instead of a few large ones;
* ``raw_write_files``: as ``raw_write`` plus the small files and fsyncs a refckpt save makes
  besides its shard (commit record, pointer, directory fsyncs): equal file counts;
* ``raw_overwrite``: the same bytes written over a file already in the page cache (no new pages
  to allocate): what page allocation costs;
* ``refckpt_save``: ``DistributedCheckpointer().save`` (sync), split into its file operations;
* ``raw_write_tmpfs`` / ``refckpt_save_tmpfs``: both into ``/dev/shm`` without fsync: no disk
  at all, only the copy into the page cache and the CPU work;
* ``touch_fresh`` / ``touch_warm``: filling a newly allocated buffer of the state's size, and
  one already mapped: the page-fault cost on its own.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

from . import ops
from .probes import SchedClock, dirty_kib, fs_of, fsync_dir, machine, prefault, settle_dirty
from .state import MIXES, build_state, tensors
from .stats import summary

MiB = 1 << 20

PROBES: dict[str, str] = {
    "raw_write": "64 MiB writes to one new file + fsync (file, dir), after os.sync()",
    "raw_write_nosettle": "the same right after deleting the previous files, no os.sync() first",
    "raw_write_per_tensor": "one write per tensor (16 MiB pieces) to one new file + fsync: refckpt's write pattern",
    "raw_write_files": "raw_write + the small files and fsyncs a refckpt save makes besides its shard",
    "raw_write_prefaulted": "raw_write right after touching and freeing a buffer of the state's size (untimed)",
    "raw_overwrite": "the same bytes over a file already in the page cache (no page allocation) + fsync",
    "refckpt_save": "refckpt sync save",
    "refckpt_save_gc_first": "refckpt sync save after an untimed gc.collect()",
    "refckpt_save_prefaulted": "refckpt save after gc.collect() and touching and freeing a buffer of the state's size (untimed)",
    "raw_write_tmpfs": "raw_write into /dev/shm without fsync: no disk",
    "refckpt_save_tmpfs": "refckpt save into /dev/shm, sync_files=False: no disk",
    "touch_fresh": "fill a newly allocated buffer of the state's size (page faults)",
    "touch_warm": "fill a buffer of the state's size that is already mapped",
}


def _timing_io():
    from refckpt import FileIO

    class TimingIO(FileIO):
        """Seconds and calls inside each kind of file operation of a save."""

        def __init__(self) -> None:
            self.t: dict[str, float] = {}
            self.n: dict[str, int] = {}

        def _add(self, k: str, t0: float) -> None:
            self.t[k] = self.t.get(k, 0.0) + time.perf_counter() - t0
            self.n[k] = self.n.get(k, 0) + 1

        def write(self, f, data) -> int:
            t0 = time.perf_counter()
            n = super().write(f, data)
            self._add("write", t0)
            return n

        def fsync(self, f) -> None:
            t0 = time.perf_counter()
            super().fsync(f)
            self._add("fsync", t0)

        def fsync_dir(self, path: str) -> None:
            t0 = time.perf_counter()
            super().fsync_dir(path)
            self._add("fsync_dir", t0)

        def replace(self, src: str, dst: str) -> None:
            t0 = time.perf_counter()
            super().replace(src, dst)
            self._add("rename", t0)

    return TimingIO()


def _write_per_tensor(path: str, named) -> None:
    with open(path, "wb", buffering=0) as f:
        for _n, t in named:
            view = memoryview(t.contiguous().view(-1).numpy()).cast("B") if t.numel() else memoryview(b"")
            for pos in range(0, len(view), 16 * MiB):
                piece = view[pos:pos + 16 * MiB]
                done = 0
                while done < len(piece):
                    done += f.write(piece[done:])
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def _small_durable(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(data)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _raw_files(d: str, flat) -> None:
    """What a refckpt save does to the disk at world size 1, with raw writes: the shard into a
    staging directory, the commit record, the rename into place, the pointer; every fsync."""
    stage = os.path.join(d, "stage")
    os.mkdir(stage)
    fsync_dir(d)
    ops.raw_write(os.path.join(stage, "shard.bin"), flat)
    _small_durable(os.path.join(stage, "record"), b"r" * 200_000)
    final = os.path.join(d, "final")
    os.rename(stage, final)
    fsync_dir(d)
    _small_durable(os.path.join(d, "pointer"), b"1\n")


class Probe:
    """One mix's state and the operations above."""

    def __init__(self, mix: str, size_bytes: int, base: str, shm: str | None) -> None:
        import torch

        self.mix, self.base, self.shm = mix, base, shm
        self.model, self.opt, self.state, _dims = build_state(size_bytes, mix)
        self.named = list(tensors(self.state))
        sizes = [t.numel() * t.element_size() for _n, t in self.named]
        self.flat = torch.empty(sum(sizes), dtype=torch.uint8)
        pos = 0
        for (_n, t), n in zip(self.named, sizes):
            self.flat[pos:pos + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            pos += n
        self.warm = torch.empty_like(self.flat).fill_(1)
        self.cached = os.path.join(base, f"{mix}-cached.bin")
        ops.raw_write(self.cached, self.flat)
        self.tensors = len(sizes)
        self.runs: dict[str, list[dict]] = {k: [] for k in PROBES}

    def run(self, key: str, rep: int) -> None:
        where = self.shm if key.endswith("_tmpfs") else self.base
        if where is None:
            return
        d = os.path.join(where, f"{self.mix}-{key}-{rep}")
        os.makedirs(d)
        fsync_dir(where)
        extra: dict[str, Any] = {}
        pre = dirty_kib()
        if key in ("refckpt_save_gc_first", "refckpt_save_prefaulted"):
            gc.collect()
        if key == "raw_write_nosettle":  # straight after the previous operation, as it left things
            settle: dict[str, float] = {"dirty_kib": pre.get("Dirty", 0), "writeback_kib": pre.get("Writeback", 0)}
        else:
            settle = settle_dirty()
        fn, io = self._op(key, d)
        if key.endswith("_prefaulted"):
            prefault(self.flat.numel())
        clock = SchedClock()
        fn()
        rec = clock.stop()
        rec["s"] = time.perf_counter() - clock.t0
        if io is not None:
            extra = {"io_s": dict(io.t), "io_calls": dict(io.n)}
        self.runs[key].append(rec | settle | extra)
        shutil.rmtree(d)

    def _op(self, key: str, d: str):
        import torch

        from refckpt import DistributedCheckpointer

        fp = os.path.join(d, "raw.bin")
        if key in ("raw_write", "raw_write_nosettle", "raw_write_tmpfs", "raw_write_prefaulted"):
            sync = key != "raw_write_tmpfs"
            return (lambda: ops.raw_write(fp, self.flat) if sync else _write_nosync(fp, self.flat)), None
        if key == "raw_write_per_tensor":
            return (lambda: _write_per_tensor(fp, self.named)), None
        if key == "raw_write_files":
            return (lambda: _raw_files(d, self.flat)), None
        if key == "raw_overwrite":
            return (lambda: _overwrite(self.cached, self.flat)), None
        if key in ("refckpt_save", "refckpt_save_gc_first", "refckpt_save_prefaulted", "refckpt_save_tmpfs"):
            io = _timing_io()
            ckpt = DistributedCheckpointer(io=io, sync_files=key != "refckpt_save_tmpfs")

            def save() -> None:
                ckpt.save(d, self.state, global_step=1)
                ckpt.close()

            return save, io
        if key == "touch_fresh":
            return (lambda: torch.empty_like(self.flat).fill_(2)), None
        if key == "touch_warm":
            return (lambda: self.warm.fill_(3)), None
        raise KeyError(key)


def _write_nosync(path: str, buf) -> None:
    view = memoryview(buf.numpy()).cast("B")
    with open(path, "wb", buffering=0) as f:
        pos = 0
        while pos < len(view):
            pos += f.write(view[pos:pos + ops.CHUNK])


def _overwrite(path: str, buf) -> None:
    view = memoryview(buf.numpy()).cast("B")
    with open(path, "r+b", buffering=0) as f:
        pos = 0
        while pos < len(view):
            pos += f.write(view[pos:pos + ops.CHUNK])
        os.fsync(f.fileno())


def _med(runs: list[dict], k: str) -> float | None:
    xs = [r[k] for r in runs if k in r]
    return statistics.median(xs) if xs else None


def analyse(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per operation: wall and its parts (median (min..max)); the paired save/raw ratios, on wall
    time and on wall time less the time spent waiting for a CPU; how the swing relates to that wait."""
    out: dict[str, Any] = {"ops": {}, "pairs": {}}
    for key, rs in runs.items():
        if not rs:
            continue
        rec: dict[str, Any] = {"n": len(rs)}
        for k in ("s", "cpu_s", "runq_s", "blocked_s", "proc_cpu_s", "gc_s", "gc_full", "dirty_kib", "writeback_kib"):
            xs = [r[k] for r in rs if k in r]
            if xs:
                rec[k] = summary(xs)
        if rs[0].get("io_s") is not None:
            rec["io_s"] = {k: statistics.median([r["io_s"].get(k, 0.0) for r in rs]) for k in rs[0]["io_s"]}
            rec["io_calls"] = rs[0]["io_calls"]
            rec["outside_io_s"] = statistics.median([r["s"] - sum(r["io_s"].values()) for r in rs])
        out["ops"][key] = rec
    for num, den in (("refckpt_save", "raw_write"), ("refckpt_save_gc_first", "raw_write"),
                     ("refckpt_save_prefaulted", "raw_write_prefaulted"), ("raw_write_prefaulted", "raw_write"),
                     ("refckpt_save", "raw_write_per_tensor"),
                     ("refckpt_save", "raw_write_files"), ("raw_write_nosettle", "raw_write"),
                     ("refckpt_save_tmpfs", "raw_write_tmpfs")):
        a, b = runs.get(num) or [], runs.get(den) or []
        n = min(len(a), len(b))
        if not n:
            continue
        wall = [b[i]["s"] / a[i]["s"] for i in range(n)]  # throughput ratio: den time / num time
        pair: dict[str, Any] = {"wall": summary(wall), "runs_wall": wall}
        nogc = [(b[i]["s"] - b[i]["gc_s"]) / (a[i]["s"] - a[i]["gc_s"]) for i in range(n)]
        pair["less_gc"] = summary(nogc)
        pair["runs_less_gc"] = nogc
        if all("runq_s" in r for r in a[:n] + b[:n]):
            net = [(b[i]["s"] - b[i]["runq_s"]) / (a[i]["s"] - a[i]["runq_s"]) for i in range(n)]
            pair["less_cpu_wait"] = summary(net)
            pair["runs_less_cpu_wait"] = net
            share = [a[i]["runq_s"] / a[i]["s"] - b[i]["runq_s"] / b[i]["s"] for i in range(n)]
            pair["spearman_ratio_vs_wait_share_gap"] = _spearman(wall, share) if n >= 3 else None
        out["pairs"][f"{num}/{den}"] = pair
    return out


def _spearman(x: list[float], y: list[float]) -> float | None:
    def ranks(v: list[float]) -> list[float]:  # ties share their mean rank
        return [statistics.mean(j for j, w in enumerate(sorted(v)) if w == x) for x in v]

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return None if not sx or not sy else sxy / (sx * sy)


def _f(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.{digits}g}"


def _sp(s: dict | None) -> str:
    return "n/a" if s is None else f"{_f(s['median'])} ({_f(s['min'])}..{_f(s['max'])})"


def render(result: dict[str, Any]) -> str:
    lines = ["# Why the sync-save ratio swings: probe", "",
             f"- command: `{result['command']}`", f"- date: {result['date']}",
             f"- dir: {result['dir']} ({result['fs']}); tmpfs: {result['shm'] or 'n/a'}",
             f"- {result['repeats']} rounds, operations rotated by one per round; load average {result['loadavg']}",
             f"- CPU pressure (/proc/pressure/cpu) at the end: {result.get('cpu_pressure') or 'n/a'}",
             "- per operation: wall s, and the calling thread's time on a CPU, waiting for a CPU (run queue), "
             "blocked (I/O, fsync, helper threads); Dirty + Writeback (KiB) right before it", ""]
    for mix, res in result["mixes"].items():
        an = res["analysis"]
        lines += [f"## `{mix}`: {res['tensors']} tensors, {res['payload_bytes'] / MiB:.0f} MiB", "",
                  "| operation | wall s | on CPU s | waiting for a CPU s | blocked s | process CPU s | GC s | full GCs "
                  "| Dirty KiB | Writeback KiB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key, desc in PROBES.items():
            rec = an["ops"].get(key)
            if rec is None:
                continue
            lines.append(f"| {key}: {desc} | " + " | ".join(_sp(rec.get(k)) for k in
                         ("s", "cpu_s", "runq_s", "blocked_s", "proc_cpu_s", "gc_s", "gc_full", "dirty_kib",
                          "writeback_kib")) + " |")
        for key in ("refckpt_save", "refckpt_save_gc_first", "refckpt_save_prefaulted", "refckpt_save_tmpfs"):
            rec = an["ops"].get(key)
            if rec and "io_s" in rec:
                parts = ", ".join(f"{k} {_f(v)} s ({rec['io_calls'].get(k, 0)} calls)" for k, v in rec["io_s"].items())
                lines.append(f"\n- `{key}` medians inside file operations: {parts}; outside them "
                             f"(planning, metadata, checksums) {_f(rec['outside_io_s'])} s")
        lines += ["", "| throughput ratio (per round, paired) | wall: median (min..max) | wall less GC | wall less CPU wait | "
                  "Spearman(ratio, CPU-wait share gap) |", "|---|---:|---:|---:|---:|"]
        for name, p in an["pairs"].items():
            lines.append(f"| {name} | {_sp(p['wall'])} | {_sp(p.get('less_gc'))} | {_sp(p.get('less_cpu_wait'))} | "
                         f"{_f(p.get('spearman_ratio_vs_wait_share_gap'), 2)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _cpu_pressure() -> str | None:
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


def probe_swing(size_mib: float, repeats: int, parent: str | None, mixes: list[str], command: str,
                quiet: bool = False) -> dict[str, Any]:
    """Run the probe; the result (raw runs, analysis) as a dict :func:`render` prints."""
    import datetime

    base = tempfile.mkdtemp(prefix="refckpt-swing-", dir=parent)
    shm = tempfile.mkdtemp(prefix="refckpt-swing-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    t_start = time.monotonic()
    say = (lambda msg: None) if quiet else (
        lambda msg: print(f"[swing {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True))
    result: dict[str, Any] = {"command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                              "dir": base, "fs": fs_of(base), "shm": shm, "repeats": repeats,
                              "loadavg": "/".join(f"{x:.1f}" for x in os.getloadavg()), "machine": machine(), "mixes": {}}
    keys = list(PROBES)
    try:
        with warnings.catch_warnings():  # DCP warns that this process has no process group: intended
            warnings.simplefilter("ignore")
            for mix in mixes:
                say(f"{mix}: building a {size_mib:.0f} MiB state")
                p = Probe(mix, int(size_mib * MiB), base, shm)
                p.run("refckpt_save", -1)  # warm-up: imports, first-call setup
                p.runs["refckpt_save"].clear()
                for rep in range(repeats):
                    say(f"{mix}: round {rep + 1}/{repeats}")
                    k = rep % len(keys)
                    for key in keys[k:] + keys[:k]:
                        p.run(key, rep)
                result["mixes"][mix] = {"tensors": p.tensors, "payload_bytes": p.flat.numel(), "runs": p.runs,
                                        "analysis": analyse(p.runs)}
                del p
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    result["cpu_pressure"] = _cpu_pressure()
    return result


__all__ = ["PROBES", "MIXES", "analyse", "probe_swing", "render"]
