"""Statistics and verdicts: min / median / max of every figure, ratios of medians with their
spread over repeats, and a verdict for every ratio that has a target.

Why ratios of medians, and why a range beside them: a shared disk is noisy (in one run the raw
write ranged from 0.91x to 2.71x its own median), so one run's ratio settles nothing. Each
repeat times every operation in turn, so repeat *i* gives one *paired* ratio (refckpt's time
over the baseline's, both from the same minutes of the same disk); the headline is the ratio of
the medians, and the range is the smallest to the largest paired ratio. The ratio of medians
always lies inside that range (if ``a_i >= r * b_i`` for every *i*, then
``median(a) >= r * median(b)``). A target is **met** when it holds at both ends of the range,
**not met** when it holds at neither, and **within noise** when the range straddles it: the
repeats disagree, and more repeats or a quieter disk are needed to decide.
"""

from __future__ import annotations

import operator
import statistics
from dataclasses import dataclass
from typing import Any

VERDICTS = ("met", "not met", "within noise")

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass(frozen=True)
class Target:
    """``value <op> threshold`` must hold; ``source`` says who set it."""

    op: str
    threshold: float
    source: str
    text: str = ""  # how the report prints it, when not ``op threshold``

    def holds(self, v: float) -> bool:
        return bool(_OPS[self.op](v, self.threshold))

    def __str__(self) -> str:
        return self.text or f"{self.op} {self.threshold:g}"


def verdict(lo: float, hi: float, target: Target) -> str:
    """``met`` if ``target`` holds over the whole range ``[lo, hi]``, ``not met`` if nowhere in it,
    ``within noise`` if the range straddles the threshold. A target is a half-line, so holding
    at both ends is holding everywhere between; a value *on* the threshold counts as holding for
    ``>=`` / ``<=`` and not for ``>`` / ``<``."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    at_lo, at_hi = target.holds(lo), target.holds(hi)
    if at_lo and at_hi:
        return "met"
    if not at_lo and not at_hi:
        return "not met"
    return "within noise"


@dataclass(frozen=True)
class Ratio:
    """How a ratio is computed, per repeat and from the medians.

    ``kind``: ``speedup`` = den time / num time (refckpt's throughput over the baseline's);
    ``time`` = num time / den time; ``pct`` = (num - den) / den in percent; ``peak`` = num's peak
    extra memory / the largest shard file; ``peak_state`` = num's peak extra memory (largest over
    ranks) / the state's bytes on one rank (the largest rank's share)."""

    desc: str
    kind: str
    num: str
    den: str | None = None


RATIOS: dict[str, Ratio] = {
    "save_vs_raw": Ratio("refckpt sync save throughput / raw write + fsync", "speedup", "refckpt_save", "raw_write"),
    "load_vs_raw": Ratio("refckpt cold load throughput / raw read of the same shard files", "speedup", "refckpt_load",
                         "raw_read_ckpt"),
    "save_vs_dcp": Ratio("refckpt save throughput / plain DCP save", "speedup", "refckpt_save", "dcp_save"),
    "load_vs_dcp": Ratio("refckpt load throughput / plain DCP load", "speedup", "refckpt_load", "dcp_load"),
    "deferred_blocked_vs_sync": Ratio("deferred async save, caller blocked (steady state) / sync save time", "time",
                                      "refckpt_deferred_blocked", "refckpt_save"),
    "train_deferred_vs_idle": Ratio("training per-step time, deferred save every k steps / no save", "time",
                                    "train_deferred", "train_none"),
    "train_sync_vs_idle": Ratio("training per-step time, sync save every k steps / no save", "time", "train_sync",
                                "train_none"),
    "train_async_vs_idle": Ratio("training per-step time, async (copy) save every k steps / no save", "time",
                                 "train_async", "train_none"),
    "async_blocked_vs_sync": Ratio("async (copy) save, caller blocked (steady state) / sync save time", "time",
                                   "refckpt_async_blocked", "refckpt_save"),
    "async_blocked_vs_memcpy": Ratio("async (copy) save, caller blocked / memory copy time", "time",
                                     "refckpt_async_blocked", "memcpy"),
    "async_durable_vs_sync": Ratio("async (copy) save, time to durable / sync save time", "time", "refckpt_async_durable",
                                   "refckpt_save"),
    "deferred_durable_vs_sync": Ratio("deferred async save, time to durable / sync save time", "time",
                                      "refckpt_deferred_durable", "refckpt_save"),
    "save_vs_dcp_st": Ratio("refckpt save throughput / DCP safetensors save", "speedup", "refckpt_save", "dcp_st_save"),
    "save_vs_torch_save": Ratio("refckpt save throughput / torch.save (each rank its share)", "speedup", "refckpt_save",
                                "torch_save"),
    "save_vs_safetensors": Ratio("refckpt sync save throughput / safetensors save_file + fsync (each rank its share)",
                                 "speedup", "refckpt_save", "safetensors_save"),
    "load_vs_safetensors": Ratio("refckpt cold load throughput / safetensors load_file + copy into the state (each "
                                 "rank its share)", "speedup", "refckpt_load", "safetensors_load"),
    "load_vs_safetensors_lazy": Ratio("refckpt cold load throughput / safetensors load_file alone (maps the file, "
                                      "reads nothing)", "speedup", "refckpt_load", "safetensors_load_lazy"),
    "load_vs_torch_load": Ratio("refckpt cold load throughput / torch.load (each rank its share)", "speedup",
                                "refckpt_load", "torch_load"),
    "peak_rss_save_vs_state": Ratio("peak RSS growth, sync save / the state's bytes (per rank)", "peak_state",
                                    "refckpt_save"),
    "peak_rss_load_vs_state": Ratio("peak RSS growth, load / the state's bytes (per rank)", "peak_state", "refckpt_load"),
    "load_vs_raw_other_file": Ratio("refckpt load throughput / raw read of a separate file (raw_read)", "speedup",
                                    "refckpt_load", "raw_read"),
    "load_vs_dcp_st": Ratio("refckpt load throughput / DCP safetensors load", "speedup", "refckpt_load", "dcp_st_load"),
    "checksum_overhead_save_pct": Ratio("checksum overhead, save (%)", "pct", "refckpt_save", "refckpt_save_nochecksum"),
    "checksum_overhead_load_pct": Ratio("checksum overhead, load (%)", "pct", "refckpt_load", "refckpt_load_nochecksum"),
    "transaction_overhead_load_pct": Ratio("transactional load's overhead over one pass of the same reader (%)", "pct",
                                           "refckpt_load", "refckpt_load_onepass"),
    "peak_mem_save_vs_shard": Ratio("peak extra memory, sync save / largest shard", "peak", "refckpt_save"),
    "peak_mem_load_vs_shard": Ratio("peak extra memory, load / largest shard", "peak", "refckpt_load"),
    "peak_mem_async_vs_shard": Ratio("peak extra memory, async save / largest shard", "peak", "refckpt_async_durable"),
    "peak_mem_dcp_save_vs_shard": Ratio("peak extra memory, plain DCP save / largest shard", "peak", "dcp_save"),
    "peak_mem_dcp_load_vs_shard": Ratio("peak extra memory, plain DCP load / largest shard", "peak", "dcp_load"),
}

#: find_latest_checkpoint checks (computed by :mod:`benchmarks.scan`; reported, no target).
SCAN_CHECKS: dict[str, str] = {
    "find_latest_valid_pointer_scaling": "find_latest, valid pointer: time at most dirs / at fewest",
    "find_latest_scan_max_s": "find_latest, worst-case scan at most dirs (s)",
}

_ISSUE15 = "issue 15"
_ISSUE30 = "issue 30"
#: Every target, in one table: ratio key -> target, with where it comes from. Each is judged on
#: the medians of one interleaved run, with its verdict from the spread of the paired ratios.
TARGETS: dict[str, Target] = {
    "deferred_blocked_vs_sync": Target("<=", 0.01, _ISSUE15),
    "train_deferred_vs_idle": Target("<=", 1.02, _ISSUE15),
    "save_vs_raw": Target(">=", 0.9, _ISSUE15),
    "load_vs_raw": Target(">=", 0.9, _ISSUE30),  # issue 15 asked 0.95; issue 30 set 0.9 beside the formats' own
    "save_vs_dcp": Target(">=", 1.5, _ISSUE15),
    "load_vs_dcp": Target(">=", 1.5, _ISSUE15),
    "save_vs_safetensors": Target(">=", 0.95, _ISSUE30),
    "load_vs_safetensors": Target(">=", 0.95, _ISSUE30),
    "load_vs_torch_load": Target(">=", 0.95, _ISSUE30),
    "peak_rss_save_vs_state": Target("<=", 0.1, _ISSUE30),
    "peak_rss_load_vs_state": Target("<=", 0.1, _ISSUE30),
    "async_blocked_vs_memcpy": Target("<=", 1.0, _ISSUE30),
}

#: How far the machine lets each throughput target go: target key -> (baseline, ceiling) timings.
#: refckpt's save cannot beat the raw write (nor its load the raw read of its own files), so the
#: best ``save_vs_dcp`` this disk allows is (plain DCP save time / raw write time), per repeat.
CEILINGS: dict[str, tuple[str, str]] = {
    "save_vs_dcp": ("dcp_save", "raw_write"),
    "load_vs_dcp": ("dcp_load", "raw_read_ckpt"),
}
#: What the best reachable value's verdict reads as.
REACH = {"met": "reachable", "not met": "out of reach", "within noise": "within noise"}


def summary(xs: list[float]) -> dict[str, float]:
    """min, median, max of ``xs`` (not empty)."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


#: What every timed record also carries (:class:`benchmarks.probes.SchedClock`, :meth:`benchmarks.measure.Ctx.settle`):
#: the main thread's seconds waiting for a CPU and blocked, the process's CPU seconds, the garbage
#: collector's seconds, and the system's dirty / under-write-back KiB when the operation started.
DIAGNOSTICS = ("runq_s", "blocked_s", "proc_cpu_s", "gc_s", "dirty_kib", "writeback_kib")


def combine(per_rank: list[dict], keys) -> dict[str, Any]:
    """Per measurement, from every rank's ``runs``: each repeat's slowest rank, then min / median /
    max over repeats (None where nothing was measured)."""
    out: dict[str, Any] = {}
    for key in keys:
        runs_by_rank = [r["runs"][key] for r in per_rank]
        n = min(len(x) for x in runs_by_rank)
        if n == 0:
            out[key] = None
            continue
        s_runs = [max(rr[i]["s"] for rr in runs_by_rank) for i in range(n)]
        rec: dict[str, Any] = {
            "seconds": summary(s_runs),
            "runs_seconds": s_runs,
            "per_rank_seconds": [[rr[i]["s"] for rr in runs_by_rank] for i in range(n)],
        }
        if all(rr[i].get("peak") is not None for rr in runs_by_rank for i in range(n)):
            peak_runs = [max(rr[i]["peak"] for rr in runs_by_rank) for i in range(n)]
            rec["peak_extra_bytes"] = summary(peak_runs)
            rec["runs_peak_extra_bytes"] = peak_runs
        if all("disk" in rr[0] for rr in runs_by_rank):
            rec["disk_bytes"] = statistics.median([sum(rr[i]["disk"] for rr in runs_by_rank) for i in range(n)])
        if "steps" in runs_by_rank[0][0]:
            rec["steps"] = [rr[i]["steps"] for rr in runs_by_rank for i in range(n)]
            rec["saves"] = [rr[i]["saves"] for rr in runs_by_rank for i in range(n)]
        for diag in DIAGNOSTICS:  # per repeat the largest over ranks, then min / median / max
            if all(diag in rr[i] for rr in runs_by_rank for i in range(n)):
                rec[diag] = summary([max(rr[i][diag] for rr in runs_by_rank) for i in range(n)])
        out[key] = rec
    return out


def _ratio_runs(spec: Ratio, res: dict, largest_shard: int, rank_state_bytes: int = 0) -> tuple[float, list[float]] | None:
    """(headline value, per-repeat paired values) of one ratio, or None where it cannot be computed."""
    a_rec = res.get(spec.num)
    if a_rec is None:
        return None
    if spec.kind in ("peak", "peak_state"):
        per = largest_shard if spec.kind == "peak" else rank_state_bytes
        peaks = a_rec.get("runs_peak_extra_bytes")
        if peaks is None or not per:
            return None
        return statistics.median(peaks) / per, [p / per for p in peaks]
    b_rec = res.get(spec.den or "")
    if b_rec is None:
        return None
    n = min(len(a_rec["runs_seconds"]), len(b_rec["runs_seconds"]))
    a, b = a_rec["runs_seconds"][:n], b_rec["runs_seconds"][:n]
    if min(a) <= 0 or min(b) <= 0:
        return None
    ma, mb = statistics.median(a), statistics.median(b)
    if spec.kind == "speedup":
        return mb / ma, [y / x for x, y in zip(a, b)]
    if spec.kind == "time":
        return ma / mb, [x / y for x, y in zip(a, b)]
    if spec.kind == "pct":
        return (ma - mb) / mb * 100, [(x - y) / y * 100 for x, y in zip(a, b)]
    raise ValueError(f"unknown ratio kind {spec.kind!r}")


def judged(key: str, value: float | None, lo: float | None, hi: float | None, **extra) -> dict[str, Any]:
    """One ratio or check as the report holds it: value, range, target, source, verdict."""
    target = TARGETS.get(key)
    v = None if target is None or value is None or lo is None or hi is None else verdict(lo, hi, target)
    return {"value": value, "min": lo, "max": hi, "target": None if target is None else str(target),
            "source": None if target is None else target.source, "verdict": v} | extra


def ratios(res: dict, largest_shard: int, rank_state_bytes: int = 0) -> dict[str, dict[str, Any]]:
    """Every ratio of one world size and mix, with its range over repeats and verdict
    (``rank_state_bytes``: the largest rank's share of the state, for the ``peak_state`` ratios)."""
    out = {}
    for key, spec in RATIOS.items():
        got = _ratio_runs(spec, res, largest_shard, rank_state_bytes)
        if got is None:
            out[key] = judged(key, None, None, None, runs=[])
        else:
            value, runs = got
            out[key] = judged(key, value, min(runs), max(runs), runs=runs)
    return out


def _paired(res: dict, num: str, den: str) -> list[float] | None:
    """Per repeat, ``num``'s time / ``den``'s time (None where either was not measured)."""
    a, b = res.get(num), res.get(den)
    if a is None or b is None:
        return None
    n = min(len(a["runs_seconds"]), len(b["runs_seconds"]))
    if not n or min(b["runs_seconds"][:n]) <= 0:
        return None
    return [x / y for x, y in zip(a["runs_seconds"][:n], b["runs_seconds"][:n])]


def ceilings(res: dict, state_bytes: int) -> dict[str, Any]:
    """The disk's limits beside the targets, for one world size and mix: raw write and read speeds
    (GB/s of the median time), and for each target in :data:`CEILINGS` the best value refckpt could
    reach here, per repeat (baseline time / raw time: a refckpt as fast as the raw disk), with
    whether the target is reachable at all (``reachable`` / ``out of reach`` / ``within noise``,
    from the same rule as the verdicts)."""
    out: dict[str, Any] = {}
    for key, meas in (("raw_write_gbps", "raw_write"), ("raw_read_gbps", "raw_read_ckpt")):
        rec = res.get(meas)
        out[key] = None if rec is None else {k: state_bytes / v / 1e9 for k, v in
                                             (("median", rec["seconds"]["median"]), ("min", rec["seconds"]["max"]),
                                              ("max", rec["seconds"]["min"]))}
    for key, (base, raw) in CEILINGS.items():
        runs = _paired(res, base, raw)
        if runs is None:
            out[key] = None
            continue
        value = statistics.median(res[base]["runs_seconds"][:len(runs)]) / statistics.median(res[raw]["runs_seconds"][:len(runs)])
        reach = REACH[verdict(min(runs), max(runs), TARGETS[key])]
        out[key] = {"value": value, "min": min(runs), "max": max(runs), "runs": runs, "target": str(TARGETS[key]),
                    "reach": reach}
    return out


def train_floor(res: dict, cores: int | None, steps: int, saves: int) -> dict[str, Any] | None:
    """A floor under ``train_deferred_vs_idle`` on this machine: a deferred save still does all of a
    sync save's work, on other threads; if the training loop keeps every core busy, the run gets
    longer by at least that work's CPU seconds / cores. ``1 + saves * (process CPU s of a sync save)
    / (cores * steps * step time without saves)``, from the medians (an estimate: a loop that
    leaves cores idle can hide more)."""
    save, none = res.get("refckpt_save"), res.get("train_none")
    if save is None or none is None or not cores or not saves or "proc_cpu_s" not in save:
        return None
    cpu = save["proc_cpu_s"]["median"]
    step = none["seconds"]["median"]
    return {"value": 1 + saves * cpu / (cores * steps * step), "save_cpu_s": cpu, "cores": cores, "saves": saves,
            "steps": steps, "step_s": step}
