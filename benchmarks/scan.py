"""``find_latest_checkpoint`` on roots with many step directories (in the parent process).

Per step count: a root whose newest step is complete, read with a valid pointer and with a torn
(empty) one, and the worst case: pointer torn, the only complete steps are the oldest two and
every newer directory is an unfinished save that must be checked. Each case is timed as the
median of repeated calls (warm dentry cache), ``repeats`` times in turn.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings
from typing import Any

from .stats import judged, summary

#: Scenarios: key -> description.
SCAN_CASES = {
    "valid_pointer": "pointer names the newest step, which is complete",
    "torn_pointer": "pointer torn (empty); newest step complete",
    "scan_worst": "pointer torn; every step newer than the 2 complete (oldest) ones is unfinished",
}


def make_root(root: str, n: int, complete_newest: bool, state: dict) -> None:
    """``n`` step directories, two of them complete (saved, each under its own step number: a
    record names its step), the others unfinished saves (no commit record)."""
    from refckpt import DistributedCheckpointer

    os.makedirs(root)
    complete = {n - 1, n} if complete_newest else {1, 2}
    for step in range(1, n + 1):
        if step not in complete:
            os.mkdir(os.path.join(root, f"global_step_{step}"))  # an unfinished save: no commit record
    with warnings.catch_warnings():  # DCP warns that this process has no process group: intended
        warnings.simplefilter("ignore")
        for step in sorted(complete):
            DistributedCheckpointer().save(root, state, global_step=step)


def per_call(fn, min_time: float = 0.2, max_calls: int = 2000) -> tuple[float, int]:
    """Median seconds per call of ``fn`` over at least 3 calls and ``min_time`` seconds."""
    times: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def bench_find_latest(base: str, counts: list[int], repeats: int) -> dict[str, Any]:
    """Per step count and case: microseconds per call, min / median / max over ``repeats``."""
    import torch

    from refckpt import LATEST_CHECKPOINT_FILE, find_latest_checkpoint

    template = {"model": {"w": torch.ones(4)}}
    out: dict[str, Any] = {}
    for n in counts:
        n = max(n, 2)
        root = os.path.join(base, f"scan-{n}")
        worst = os.path.join(base, f"scan-worst-{n}")
        make_root(root, n, True, template)
        make_root(worst, n, False, template)
        pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
        with open(os.path.join(worst, LATEST_CHECKPOINT_FILE), "w"):
            pass  # torn: empty
        runs: dict[str, list[float]] = {k: [] for k in SCAN_CASES}
        calls: dict[str, int] = dict.fromkeys(SCAN_CASES, 0)
        for _ in range(repeats):
            for case in SCAN_CASES:
                where = worst if case == "scan_worst" else root
                if case != "scan_worst":
                    with open(pointer, "w") as f:
                        f.write(f"{n}\n" if case == "valid_pointer" else "")
                want = os.path.join(where, f"global_step_{2 if case == 'scan_worst' else n}")
                assert find_latest_checkpoint(where) == want, (case, find_latest_checkpoint(where))
                s, c = per_call(lambda: find_latest_checkpoint(where))  # noqa: B023 - called right here
                runs[case].append(s * 1e6)
                calls[case] += c
        shutil.rmtree(root)
        shutil.rmtree(worst)
        out[str(n)] = {case: {"us": summary(runs[case]), "runs_us": runs[case], "calls": calls[case]} for case in SCAN_CASES}
    return out


def scan_checks(fl: dict[str, Any]) -> dict[str, Any]:
    """The find_latest checks (reported, no target): time with a valid pointer at the most dirs / at
    the fewest (paired per repeat; O(1) would be ~1), and the worst-case scan time at the most dirs."""
    counts = sorted(fl, key=int)
    lo_n, hi_n = counts[0], counts[-1]
    a, b = fl[hi_n]["valid_pointer"]["runs_us"], fl[lo_n]["valid_pointer"]["runs_us"]
    paired = [x / y for x, y in zip(a, b)]
    scaling = statistics.median(a) / statistics.median(b)
    scal = judged("find_latest_valid_pointer_scaling", scaling, min(paired), max(paired), runs=paired,
                  dirs=[int(lo_n), int(hi_n)])
    w = [x / 1e6 for x in fl[hi_n]["scan_worst"]["runs_us"]]
    worst = judged("find_latest_scan_max_s", statistics.median(w), min(w), max(w), runs=w, dirs=int(hi_n))
    return {"find_latest_valid_pointer_scaling": scal, "find_latest_scan_max_s": worst}
