"""``python -m benchmarks``: the command line, and the parent side that runs the worlds and reports."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any

from . import report as rep
from .measure import MEASUREMENTS, NO_DEFERRED, has_deferred
from .probes import fs_of, machine
from .scan import bench_find_latest, scan_checks
from .state import MIXES
from .stats import ceilings, combine, ratios, train_floor

MiB = 1 << 20


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:  # pragma: no cover - not available
        return None


def _parse_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return vals


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure refckpt against raw disk I/O, torch.save, safetensors and plain DCP, interleaved in one run.",
    )
    p.add_argument("--size-mib", type=float, default=1024.0,
                   help="total state size: fp32 params + AdamW exp_avg + exp_avg_sq (params ~ 1/3). Default 1024")
    p.add_argument("--mix", choices=(*MIXES, "both"), default="both",
                   help="state mix: few-large (12 large tensors), transformer (hundreds of tensors, ~90%% of the bytes in 6), "
                        "or both (default)")
    p.add_argument("--world-sizes", type=_parse_ints, default=[1, 2], help="gloo world sizes, comma-separated. Default 1,2")
    p.add_argument("--repeats", type=int, default=5,
                   help="repeats of every measurement, interleaved (min / median / max reported). Default 5")
    p.add_argument("--dir", default=None,
                   help="a fresh directory is made (and removed at the end) under it. Default: the system temp dir")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every raw number as JSON here")
    p.add_argument("--docs", default=None, metavar="PATH",
                   help="also write the report into PATH between its '<!-- BEGIN GENERATED' and '<!-- END GENERATED -->' "
                        "markers, stamped with this command and the date (e.g. docs/performance.md)")
    p.add_argument("--scan-steps", type=_parse_ints, default=[10, 1000, 10000],
                   help="step-directory counts for find_latest_checkpoint. Default 10,1000,10000")
    p.add_argument("--train-steps", type=int, default=24,
                   help="steps of each training run (the state's own model and AdamW), per repeat and kind of save. "
                        "Default 24")
    p.add_argument("--train-world-sizes", type=_parse_ints, default=[1],
                   help="world sizes that run the training runs (at world size > 1 each step all-gathers FSDP2 "
                        "shards over gloo: seconds per step on a small CPU machine). Default 1")
    p.add_argument("--save-every", type=int, default=8,
                   help="the training runs save after every k-th step but the last (so the last save has k steps to "
                        "finish in the background). Default 8")
    p.add_argument("--drop-caches", choices=("fadvise", "global", "none"), default="fadvise",
                   help="how to drop the page cache before reads: per-file posix_fadvise(DONTNEED) (default), "
                        "'global' = echo 1 > /proc/sys/vm/drop_caches (root; affects the whole machine), or not at all")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a world may take per world size. Default 3600")
    p.add_argument("--keep", action="store_true", help="keep the run directory (measurements still delete their files)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--probe-swing", action="store_true",
                   help="instead of the benchmark: probe what makes the sync save's ratio to the raw write swing "
                        "(world size 1; --size-mib, --mix, --repeats, --dir, --json apply; see benchmarks/swing.py)")
    return p


def run_world(ws: int, cfg: dict, timeout: float) -> list[dict]:
    """:func:`benchmarks.measure.rank_main` on ``ws`` gloo ranks; every rank's result."""
    from faults.world import World

    from . import measure  # by its module name: ranks unpickle the function by reference

    with World(ws, "gloo", timeout, start_method="forkserver") as world:
        return world.run(measure.rank_main, cfg, timeout=timeout)


def add_world(report: dict, ws: int, per_rank: list[dict]) -> None:
    """Combine one world's per-rank results into ``report``, mix by mix."""
    key = str(ws)
    for mix, out in report["mixes"].items():
        mine = [r["mixes"][mix] for r in per_rank]
        res = combine(mine, MEASUREMENTS)
        cfg = report["config"]
        payload_total = sum(r["info"]["payload_bytes"] for r in mine)
        shards = [x["largest_shard"] for x in mine[0]["runs"]["refckpt_save"]]
        largest = max(shards) if shards else max(r["info"]["payload_bytes"] for r in mine)
        out["results"][key] = res
        out["state_bytes"][key] = payload_total
        out["largest_shard_bytes"][key] = largest
        out["ratios"][key] = ratios(res, largest, max(r["info"]["payload_bytes"] for r in mine))
        out["ceilings"][key] = ceilings(res, payload_total)
        saves = len(range(cfg["save_every"], cfg["train_steps"] - cfg["save_every"] + 1, cfg["save_every"]))
        out["ceilings"][key]["train_deferred_vs_idle"] = train_floor(res, report["meta"]["machine"]["cores"],
                                                                     cfg["train_steps"], saves)
        out["per_rank"][key] = [{"rank": r["rank"], "info": r["mixes"][mix]["info"]} for r in per_rank]
        notes = []
        if ws > 1:
            notes.append("torch.save / safetensors: each rank saves and loads its own share (its local tensors), "
                         "timed between barriers like every operation")
        if not cfg["deferred"]:
            notes.append(f"deferred snapshot: {NO_DEFERRED}")
        if ws not in cfg["train_world_sizes"]:
            notes.append("no training runs at this world size (--train-world-sizes)")
        for k in ("dcp_st_unavailable",):
            if k in mine[0]["info"]:
                notes.append(f"{k}: {mine[0]['info'][k]}")
        out["notes"][key] = notes
        if "state" not in out:
            i0 = mine[0]["info"]
            out["state"] = {"payload_bytes": payload_total, "tensors": i0["tensors"], "top6_share": i0["top6_share"],
                            "largest_tensor_bytes": i0["largest_tensor_bytes"], "dims": i0["dims"]}


def cache_drop_text(drops: list[dict], requested: str) -> tuple[str, dict]:
    methods = sorted({d["method"] for d in drops})
    total = sum(d["bytes"] for d in drops)
    resident = sum(d["resident"] for d in drops)
    method_text = {"fadvise": "posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) per file after fdatasync",
                   "global": "echo 1 > /proc/sys/vm/drop_caches", "none": "not dropped"}
    text = (" + ".join(method_text.get(m, m) for m in methods)
            + (f"; mincore afterwards: {resident / MiB:.2f} of {total / MiB:.1f} MiB still resident" if total else "")
            + (f" (requested {requested}; not permitted, fell back)" if requested not in methods else ""))
    return text, {"methods": methods, "bytes": total, "resident_bytes": resident}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.repeats < 1 or args.train_steps < 1 or args.save_every < 1:
        raise SystemExit("--repeats, --train-steps and --save-every must be >= 1")
    if args.train_steps < 2 * args.save_every:
        raise SystemExit("--train-steps must be at least 2 x --save-every (a save, then save-every steps for it to finish)")
    if args.docs:  # checked before the run, not after it
        try:
            with open(args.docs, encoding="utf-8") as f:
                rep.splice(f.read(), "", "", "")
        except (OSError, ValueError) as e:
            raise SystemExit(f"--docs {args.docs}: {e} (the file must exist and carry the generated markers)") from None
    mixes = list(MIXES) if args.mix == "both" else [args.mix]
    if args.probe_swing:
        from .swing import probe_swing, render

        if args.docs:
            raise SystemExit("--probe-swing prints its own report; --docs applies to the benchmark")
        result = probe_swing(args.size_mib, args.repeats, args.dir, mixes, "python -m benchmarks " + shlex.join(argv),
                             quiet=args.quiet)
        sys.stdout.write(render(result))
        if args.json:
            rep.write_json(result, args.json)
        return 0
    parent = os.path.abspath(args.dir) if args.dir else tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="refckpt-bench-", dir=parent)
    size_bytes = int(args.size_mib * MiB)
    fs = fs_of(run_dir)
    t_start = time.monotonic()
    say = ((lambda msg: None) if args.quiet
           else (lambda msg: print(f"[bench {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)))
    say(f"writing under {run_dir} ({fs})")
    free = shutil.disk_usage(run_dir).free
    if free < 2.5 * size_bytes:
        say(f"warning: only {free / MiB:.0f} MiB free; a measurement needs about {2 * size_bytes / MiB:.0f} MiB")

    report: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python -m benchmarks " + shlex.join(argv),
            "machine": machine(),
            "dir": run_dir,
            "fs": fs,
            "loadavg": {"start": _loadavg()},
        },
        "config": {
            "size_mib": args.size_mib, "size_bytes": size_bytes, "mixes": mixes, "world_sizes": args.world_sizes,
            "repeats": args.repeats, "scan_steps": args.scan_steps, "train_steps": args.train_steps,
            "save_every": args.save_every, "train_world_sizes": args.train_world_sizes, "drop_caches": args.drop_caches,
            "deferred": has_deferred(),
        },
        "mixes": {mix: {"results": {}, "ratios": {}, "ceilings": {}, "per_rank": {}, "state_bytes": {},
                        "largest_shard_bytes": {}, "notes": {}}
                  for mix in mixes},
    }
    drops: list[dict] = []
    rss_methods: set[str] = set()
    try:
        for ws in args.world_sizes:
            base = os.path.join(run_dir, f"ws{ws}")
            os.makedirs(base)
            cfg = {"base": base, "size_bytes": size_bytes, "mixes": mixes, "repeats": args.repeats,
                   "train_steps": args.train_steps, "save_every": args.save_every, "drop_caches": args.drop_caches,
                   "quiet": args.quiet, "deferred": report["config"]["deferred"], "train": ws in args.train_world_sizes}
            say(f"world size {ws}: starting {ws} gloo rank(s)")
            per_rank = run_world(ws, cfg, args.timeout)
            say(f"world size {ws}: measured")
            add_world(report, ws, per_rank)
            for r in per_rank:
                drops.extend(r["drops"])
                if r.get("rss_method"):
                    rss_methods.add(r["rss_method"])
        say("find_latest_checkpoint scans")
        report["find_latest"] = bench_find_latest(run_dir, args.scan_steps, args.repeats)
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    report["meta"]["loadavg"]["end"] = _loadavg()
    report["scan_checks"] = scan_checks(report["find_latest"])
    report["meta"]["cache_drop"], report["meta"]["cache_drop_detail"] = cache_drop_text(drops, args.drop_caches)
    report["meta"]["rss_method"] = " / ".join(sorted(rss_methods)) or "n/a"

    sys.stdout.write(rep.render(report))
    sys.stdout.flush()
    if args.json:
        rep.write_json(report, args.json)
        say(f"wrote {args.json}")
    if args.docs:
        rep.splice_file(args.docs, rep.docs_report(report), report["meta"]["command"], report["meta"]["date"])
        say(f"wrote the generated part of {args.docs}")
    return 0
