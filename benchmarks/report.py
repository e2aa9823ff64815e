"""The report: markdown (stdout, and spliced into a document between markers) and JSON."""

from __future__ import annotations

import json
import os
import re

from .measure import MEASUREMENTS, NO_DEFERRED, NO_TRAIN, TRAIN_VARIANTS
from .scan import SCAN_CASES
from .state import MIXES
from .stats import CEILINGS, RATIOS, SCAN_CHECKS, TARGETS

MiB = 1 << 20

#: The markers a document carries around the generated part; only the text between them is replaced.
BEGIN = "<!-- BEGIN GENERATED"
END = "<!-- END GENERATED -->"


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def spread(s: dict | None, scale: float = 1.0) -> str:
    """``median (min..max)`` of a summary, scaled."""
    if s is None:
        return "n/a"
    med, lo, hi = (fmt(s[k] * scale) for k in ("median", "min", "max"))
    return med if lo == hi == med else f"{med} ({lo}..{hi})"


def ratio_cell(r: dict) -> str:
    if r["value"] is None:
        return "n/a"
    text = fmt(r["value"])
    if r["min"] is not None and (fmt(r["min"]), fmt(r["max"])) != (text, text):
        text += f" ({fmt(r['min'])}..{fmt(r['max'])})"
    if r["verdict"]:
        return f"{text} **{r['verdict']}**"
    return f"{text} ({r['note']})" if r.get("note") else text


def _why_absent(key: str, ws: str, cfg: dict) -> str:
    """Why measurement ``key`` has no figure at world size ``ws``."""
    if "deferred" in key and not cfg.get("deferred"):
        return NO_DEFERRED
    if key.startswith("train_") and int(ws) not in cfg.get("train_world_sizes", cfg["world_sizes"]):
        return NO_TRAIN
    return "n/a"


def target_cell(r: dict, key: str, ws: str, cfg: dict) -> str:
    if r["value"] is None:
        why = _why_absent(RATIOS[key].num, ws, cfg)
        if why != "n/a":
            return why
    return ratio_cell(r)


def gbps_cell(s: dict | None) -> str:
    return spread(s)


def reach_cell(c: dict | None) -> str:
    """The best value a target's ratio can reach on this machine, with its range and whether that reaches the target."""
    if c is None:
        return "n/a"
    text = fmt(c["value"])
    if (fmt(c["min"]), fmt(c["max"])) != (text, text):
        text += f" ({fmt(c['min'])}..{fmt(c['max'])})"
    return f"{text}: {c['reach']}"


def floor_cell(c: dict | None) -> str:
    return "n/a" if c is None else f"{fmt(c['value'])} ({fmt(c['save_cpu_s'])} CPU s per save, {c['cores']} cores)"


def bound_lines(report: dict, cols: list[tuple[str, str]]) -> list[str]:
    """One line per target the machine puts out of reach (or into noise), with the measured limit."""
    out = []
    for mix, ws in cols:
        ceil = report["mixes"][mix].get("ceilings", {}).get(ws, {})
        for key, (base, raw) in CEILINGS.items():
            c = ceil.get(key)
            if c is None or c["reach"] == "reachable":
                continue
            what = "save" if key.startswith("save") else "load"
            out.append(f"- bound, `{mix}` ws={ws}: refckpt's {what} cannot be faster than the raw disk ({raw}), so "
                       f"{key} <= {base} / {raw} = {fmt(c['value'])} ({fmt(c['min'])}..{fmt(c['max'])} per repeat) on this "
                       f"disk: the target {c['target']} is {c['reach']} here (plain DCP runs at {fmt(1 / c['value'])}x "
                       f"the raw speed, median; {TARGETS[key].threshold:g}x DCP needs it below "
                       f"{fmt(1 / TARGETS[key].threshold)}x)")
        fl = ceil.get("train_deferred_vs_idle")
        if fl is not None and not TARGETS["train_deferred_vs_idle"].holds(fl["value"]):
            out.append(f"- bound, `{mix}` ws={ws}: a deferred save still does a sync save's work "
                       f"({fmt(fl['save_cpu_s'])} CPU s), on other threads; with {fl['saves']} saves per run of {fl['steps']} "
                       f"steps of {fmt(fl['step_s'] * 1000)} ms on {fl['cores']} busy cores, "
                       f"train_deferred_vs_idle >= {fmt(fl['value'])} (estimate) > "
                       f"{TARGETS['train_deferred_vs_idle'].threshold:g}: out of reach on this machine at this save frequency")
    return out or ["- every target is within what this disk and machine allow"]


def _load(avg) -> str:
    return "n/a" if not avg else "/".join(f"{x:.1f}" for x in avg)


def _columns(report: dict) -> list[tuple[str, str]]:
    """(mix, world size) of every result, in run order."""
    return [(mix, str(ws)) for mix in report["config"]["mixes"] for ws in report["config"]["world_sizes"]]


def render(report: dict, level: int = 1, title: str = "refckpt benchmark") -> str:
    h = "#" * level
    meta, cfg = report["meta"], report["config"]
    wss = [str(w) for w in cfg["world_sizes"]]
    m = meta["machine"]
    lines = [
        f"{h} {title}",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- machine: {m['cores']} cores ({m['cpu']}), {m['ram_bytes'] / (1 << 30):.1f} GiB RAM, Linux {m['kernel']}, "
        f"Python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}",
        f"- dir: {meta['dir']} -- file system: {meta['fs']}",
        f"- state: {fmt(cfg['size_mib'])} MiB requested = fp32 params + AdamW exp_avg + exp_avg_sq; "
        "FSDP2-sharded at world size > 1",
    ]
    for mix in cfg["mixes"]:
        st = report["mixes"][mix]["state"]
        lines.append(f"  - `{mix}`: {st['tensors']} tensors, {st['payload_bytes'] / MiB:.1f} MiB, largest "
                     f"{st['largest_tensor_bytes'] / MiB:.2f} MiB, the 6 largest hold {st['top6_share'] * 100:.0f}% of the bytes")
    lines += [
        f"- load average (1/5/15 min) of the machine: {_load(meta.get('loadavg', {}).get('start'))} at the start, "
        f"{_load(meta.get('loadavg', {}).get('end'))} at the end ({m['cores']} cores; other jobs' load makes the ranges wider)",
        f"- page cache before reads: {meta['cache_drop']}",
        f"- peak memory: {meta['rss_method']} (increase over the RSS right before the operation)",
        f"- {cfg['repeats']} repeats; in each, every measurement in turn (order rotated by one per repeat); before every "
        "timed operation (untimed) `gc.collect()`, `os.sync()` and a wait for Dirty + Writeback to drain; each timed "
        "between barriers, the slowest rank counts",
        f"- training runs (world sizes {', '.join(map(str, cfg.get('train_world_sizes', cfg['world_sizes'])))}): "
        f"the state's own model and AdamW, {cfg['train_steps']} steps, a save after every k-th step "
        f"(k = {cfg['save_every']}) but the last, the last save waited for inside the run; per-step time = run time / steps",
        "- deferred snapshot (`save(..., save_async=True, snapshot=\"deferred\")`): "
        + ("measured" if cfg.get("deferred") else NO_DEFERRED),
        "- figures: median (min..max) over repeats; GB/s = state tensor bytes (all ranks) / median time",
        "- ratios: ratio of the medians (min..max of the per-repeat paired ratios); verdict **met** / **not met** when the "
        "target holds over the whole range / nowhere in it, **within noise** when the range straddles it",
    ]
    for mix, ws in _columns(report):
        notes = report["mixes"][mix]["notes"].get(ws)
        if notes:
            lines.append(f"- `{mix}` ws={ws}: " + "; ".join(notes))

    cols = _columns(report)
    colhead = "".join(f" {mix} ws={ws} |" for mix, ws in cols)
    lines += ["", f"{h}# Targets", "", "| ratio | target | source |" + colhead, "|---|---|---|" + "---:|" * len(cols)]
    for key in TARGETS:
        row = f"| {key}: {RATIOS[key].desc} | {TARGETS[key]} | {TARGETS[key].source} |"
        row += "".join(f" {target_cell(report['mixes'][mix]['ratios'][ws][key], key, ws, cfg)} |" for mix, ws in cols)
        lines.append(row)
    lines += ["", f"{h}# What the machine allows beside the targets", "", "| limit |" + colhead, "|---|" + "---:|" * len(cols)]
    ceil = {c: report["mixes"][c[0]].get("ceilings", {}).get(c[1], {}) for c in cols}
    for key, text in (("raw_write_gbps", "raw write + fsync, GB/s (the ceiling of save_vs_raw's refckpt side)"),
                      ("raw_read_gbps", "raw read of refckpt's shard files, GB/s (the ceiling of load_vs_raw's)")):
        lines.append(f"| {text} |" + "".join(f" {gbps_cell(ceil[c].get(key))} |" for c in cols))
    for key, (base, raw) in CEILINGS.items():
        lines.append(f"| best {key} this disk allows = {base} time / {raw} time (refckpt as fast as the raw disk); "
                     f"target {TARGETS[key]} |" + "".join(f" {reach_cell(ceil[c].get(key))} |" for c in cols))
    lines.append("| floor of train_deferred_vs_idle = 1 + saves x CPU s of a sync save / (cores x run time without "
                 "saves) (estimate) |" + "".join(f" {floor_cell(ceil[c].get('train_deferred_vs_idle'))} |" for c in cols))
    lines += [""] + bound_lines(report, cols)

    for mix in cfg["mixes"]:
        mres = report["mixes"][mix]
        lines += ["", f"{h}# State mix `{mix}`: {MIXES[mix]}", "", f"{h}## Training runs: seconds per step", "",
                  "| run |" + "".join(f" ws={w} ms per step | ws={w} / no save |" for w in wss),
                  "|---|" + "---:|" * (2 * len(wss))]
        for key, mode in TRAIN_VARIANTS.items():
            row = f"| {key}: {MEASUREMENTS[key]} |"
            for w in wss:
                r = mres["results"][w].get(key)
                ratio = mres["ratios"][w].get(f"{key}_vs_idle" if key != "train_none" else "")
                if r is None:
                    row += f" {_why_absent(key, w, cfg)} | |"
                    continue
                row += f" {spread(r['seconds'], 1000)} | {'1' if mode is None else ratio_cell(ratio) if ratio else 'n/a'} |"
            lines.append(row)
        lines += ["", f"{h}## Saves: first save vs steady state", "",
                  "| save | phase |" + "".join(f" ws={w} first save s | ws={w} later saves s |" for w in wss),
                  "|---|---|" + "---:|" * (2 * len(wss))]
        row = "| sync (plans made by the first, kept for later saves) | until durable |"
        for w in wss:
            first, later = mres["results"][w].get("refckpt_save_first"), mres["results"][w].get("refckpt_save")
            row += (f" {'n/a' if first is None else spread(first['seconds'])} |"
                    f" {'n/a' if later is None else spread(later['seconds'])} |")
        lines.append(row)
        for prefix, name in (("refckpt_async", "copy (default)"), ("refckpt_deferred", "deferred")):
            for phase in ("blocked", "durable"):
                row = f"| {name} | {'caller blocked' if phase == 'blocked' else 'until durable'} |"
                for w in wss:
                    first, later = mres["results"][w].get(f"{prefix}_{phase}_first"), mres["results"][w].get(f"{prefix}_{phase}")
                    absent = NO_DEFERRED if prefix == "refckpt_deferred" and not cfg.get("deferred") else "n/a"
                    row += (f" {absent if first is None else spread(first['seconds'])} |"
                            f" {absent if later is None else spread(later['seconds'])} |")
                lines.append(row)
        lines += ["", f"{h}## Measurements", "",
                  "| measurement |"
                  + "".join(f" ws={w} s | ws={w} GB/s | ws={w} waiting for a CPU s | ws={w} peak extra MiB | ws={w} on disk MiB |"
                            for w in wss),
                  "|---|" + "---:|" * (5 * len(wss))]
        for key, desc in MEASUREMENTS.items():
            row = f"| {key}: {desc} |"
            for w in wss:
                r = mres["results"][w].get(key)
                if r is None:
                    row += f" {_why_absent(key, w, cfg)} | | | | |"
                    continue
                train = key.startswith("train_")
                gbps = None if train else mres["state_bytes"][w] / r["seconds"]["median"] / 1e9
                disk = r.get("disk_bytes")
                row += (f" {spread(r['seconds'], 1000) + ' ms' if train else spread(r['seconds'])} | {fmt(gbps)} |"
                        f" {spread(r.get('runq_s'))} | {spread(r.get('peak_extra_bytes'), 1 / MiB)} |"
                        f" {fmt(None if disk is None else disk / MiB)} |")
            lines.append(row)
        lines += ["", f"{h}## Ratios without a target", "", "| ratio |" + "".join(f" ws={w} |" for w in wss),
                  "|---|" + "---:|" * len(wss)]
        for key, spec in RATIOS.items():
            if key not in TARGETS:
                lines.append(f"| {key}: {spec.desc} |" + "".join(f" {ratio_cell(mres['ratios'][w][key])} |" for w in wss))

    if report.get("scan_checks"):
        lines += ["", f"{h}# Checks without a target", "", "| check | value |", "|---|---:|"]
        for key, desc in SCAN_CHECKS.items():
            lines.append(f"| {key}: {desc} | {ratio_cell(report['scan_checks'][key])} |")
    fl = report.get("find_latest")
    if fl:
        lines += ["", f"{h}# find_latest_checkpoint (world size 1, warm dentry cache), microseconds per call", "",
                  "| step dirs |" + "".join(f" {k} |" for k in SCAN_CASES), "|---:|" + "---:|" * len(SCAN_CASES)]
        for n, res in fl.items():
            lines.append(f"| {n} |" + "".join(f" {spread(res[k]['us'])} |" for k in SCAN_CASES))
        lines += [""] + [f"- {k}: {d}" for k, d in SCAN_CASES.items()]
    return "\n".join(lines) + "\n"


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")


def splice(doc: str, generated: str, command: str, date: str) -> str:
    """``doc`` with the text between its generated markers replaced by ``generated``, stamped with
    the command and date; everything outside the markers is kept byte for byte. The markers are
    lines that start with :data:`BEGIN` and :data:`END` (a mention inside a line is text)."""
    begins = [m.start() for m in re.finditer("^" + re.escape(BEGIN) + ".*$", doc, re.M)]
    ends = [m.start() for m in re.finditer("^" + re.escape(END) + "$", doc, re.M)]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"expected exactly one line starting {BEGIN!r}, then one line {END!r}")
    start, end = begins[0], ends[0]
    head = f"{BEGIN} by `{command}` on {date}: do not edit by hand, rerun the command -->\n\n"
    return doc[:start] + head + generated.rstrip("\n") + "\n\n" + doc[end:]


def splice_file(path: str, generated: str, command: str, date: str) -> None:
    """:func:`splice` into the file at ``path`` (atomically replaced)."""
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    text = splice(doc, generated, command, date)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def docs_report(report: dict) -> str:
    """The markdown the docs get: the report, one heading level down."""
    return render(report, level=3, title="Results")


