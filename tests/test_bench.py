"""``python -m benchmarks`` end to end at a tiny size, and its statistics and verdicts on synthetic numbers.

The end-to-end run checks the *shape* of the report (every figure with min <= median <= max,
every ratio with its range and a verdict where it has a target, both state mixes, the docs
splice), never the timings' values: those depend on the machine and its load. The verdict
logic is checked on synthetic numbers, boundaries included, so that it can fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

from benchmarks import cli, measure, report, scan, state, stats
from benchmarks.probes import PeakRSS, drop_cache, fs_of, resident_bytes
from benchmarks.stats import Target, verdict

SCAN = [10, 50]
REPEATS = 2
DOC_HEAD = "# Performance\n\nHand-written method. Keep me.\n\n"
DOC_TAIL = "\n\n## After\n\nHand-written tail. Keep me too.\n"

# The run below happens once per session: the first xdist worker to need it runs it under a
# file lock in the session's shared temporary directory, the others read what it left there
# (xdist_group alone does not keep the module on one worker under every pytest version).
pytestmark = pytest.mark.xdist_group("refckpt-bench")


def _run_benchmark(tmp) -> None:
    doc = tmp / "performance.md"
    doc.write_text(DOC_HEAD + f"{report.BEGIN} -->\nstale table\n{report.END}" + DOC_TAIL)
    argv = ["--size-mib", "2", "--repeats", str(REPEATS), "--world-sizes", "1,2", "--scan-steps", ",".join(map(str, SCAN)),
            "--train-steps", "3", "--dir", str(tmp / "runs"), "--json", str(tmp / "bench.json"), "--docs", str(doc),
            "--timeout", "300", "--quiet"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    (tmp / "stdout.md").write_text(buf.getvalue())
    (tmp / "done.json").write_text(json.dumps({"rc": rc, "argv": argv}))


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One tiny run of the whole benchmark (both mixes, world sizes 1 and 2), shared by the tests below."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    tmp = shared / "refckpt-bench-run"
    tmp.mkdir(exist_ok=True)
    with open(shared / "refckpt-bench-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tmp / "done.json").exists():
            _run_benchmark(tmp)
    done = json.loads((tmp / "done.json").read_text())
    return {"rc": done["rc"], "argv": done["argv"], "text": (tmp / "stdout.md").read_text(), "tmp": tmp,
            "json": json.loads((tmp / "bench.json").read_text()), "doc": (tmp / "performance.md").read_text()}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ordered(s: dict) -> bool:
    return all(_number(s[k]) for k in ("min", "median", "max")) and s["min"] <= s["median"] <= s["max"]


def _cells(data: dict):
    """(mix, world size) of every result."""
    for mix in data["config"]["mixes"]:
        for ws in map(str, data["config"]["world_sizes"]):
            yield mix, ws


def test_exit_code_and_cleanup(run):
    assert run["rc"] == 0
    # every run wrote into a fresh directory under --dir, removed at the end
    assert os.listdir(run["tmp"] / "runs") == []


def test_both_mixes_are_measured(run):
    data = run["json"]
    assert data["config"]["mixes"] == ["few-large", "transformer"]
    few, tf = data["mixes"]["few-large"]["state"], data["mixes"]["transformer"]["state"]
    assert few["tensors"] <= 20 and few["top6_share"] >= 0.45
    assert tf["tensors"] >= 200 and tf["top6_share"] >= 0.85  # hundreds of tensors, ~90% of the bytes in a few
    for mix in state.MIXES:
        assert f"State mix `{mix}`" in run["text"]


def test_every_figure_has_min_median_max(run):
    data = run["json"]
    for mix, ws in _cells(data):
        res = data["mixes"][mix]["results"][ws]
        assert set(res) == set(measure.MEASUREMENTS)
        for key, rec in res.items():
            if ws == "2" and key in measure.WS1_ONLY:
                assert rec is None, key
                continue
            assert rec is not None, (mix, ws, key)
            assert _ordered(rec["seconds"]) and rec["seconds"]["min"] > 0, (mix, ws, key, rec["seconds"])
            want = 1 if key == "refckpt_async_blocked_first" else REPEATS
            assert len(rec["runs_seconds"]) == want, (mix, ws, key)
            assert all(len(r) == int(ws) for r in rec["per_rank_seconds"])
            if not key.startswith("train_"):
                assert _ordered(rec["peak_extra_bytes"]), (mix, ws, key)
            if key.endswith("_save") or key in ("raw_write", "refckpt_async_durable", "refckpt_save_nochecksum"):
                assert rec["disk_bytes"] >= data["mixes"][mix]["state_bytes"][ws] * 0.99, (mix, ws, key)
    for n in SCAN:
        for case in scan.SCAN_CASES:
            rec = data["find_latest"][str(n)][case]
            assert _ordered(rec["us"]) and len(rec["runs_us"]) == REPEATS


def test_every_ratio_has_a_range_and_a_verdict(run):
    data = run["json"]
    for mix, ws in _cells(data):
        ratios = data["mixes"][mix]["ratios"][ws]
        assert set(ratios) == set(stats.RATIOS)
        for key, r in ratios.items():
            if ws == "2" and key in ("save_vs_torch_save", "save_vs_safetensors"):
                assert r["value"] is None and r["verdict"] is None
                continue
            assert _number(r["value"]), (mix, ws, key, r)
            assert len(r["runs"]) == REPEATS and (r["min"], r["max"]) == (min(r["runs"]), max(r["runs"]))
            # the ratio of medians lies inside the range of the paired per-repeat ratios
            slack = 1e-9 * max(1.0, abs(r["value"]))
            assert r["min"] - slack <= r["value"] <= r["max"] + slack, (mix, ws, key, r)
            if key in stats.TARGETS:
                assert r["verdict"] in stats.VERDICTS, (mix, ws, key, r)
                assert r["target"] == str(stats.TARGETS[key]) and r["source"]
            else:
                assert r["verdict"] is None and r["target"] is None
    checks = data["scan_checks"]
    assert set(checks) == set(stats.SCAN_CHECKS)
    assert checks["find_latest_valid_pointer_scaling"]["verdict"] in stats.VERDICTS
    # the worst-case target is stated at 10,000 dirs: no verdict from 50
    assert checks["find_latest_scan_max_s"]["verdict"] is None and "not judged" in checks["find_latest_scan_max_s"]["note"]


def test_runs_are_interleaved_and_rotated(run):
    data = run["json"]
    for mix, ws in _cells(data):
        for r in data["mixes"][mix]["per_rank"][ws]:
            orders = r["info"]["orders"]
            assert len(orders) == REPEATS
            first = orders[0]
            assert {"raw", "dcp", "refckpt"} <= set(first)
            assert orders[1] == first[1:] + first[:1]


def test_markdown_has_every_row_target_and_verdict(run):
    text = run["text"]
    for field in ("- date:", "- command: `python -m benchmarks --size-mib 2", "- machine:", " cores", "GiB RAM",
                  "torch ", "- dir:", "file system:", "- page cache before reads:", "posix_fadvise", "- peak memory:",
                  "`os.sync()` before every timed operation", "within noise", "- load average (1/5/15 min)"):
        assert field in text, field
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip().split(":")[0], []).append(line)
    for key in measure.MEASUREMENTS:
        assert len(rows[key]) == 2, key  # one row per mix
        for row in rows[key]:
            cells = [c.strip() for c in row.split("|")[2:-1]]
            assert len(cells) == 8, row  # 4 columns x world sizes 1, 2
            assert cells[0] not in ("n/a", ""), row
            assert (cells[4] == "n/a") == (key in measure.WS1_ONLY), row
    for key in stats.RATIOS:
        if key in stats.TARGETS:
            (row,) = rows[key]
            assert f"| {stats.TARGETS[key]} | {stats.TARGETS[key].source} |" in row, row
            cells = [c.strip() for c in row.split("|")[4:-1]]
            assert len(cells) == 4, row  # 2 mixes x 2 world sizes
            assert all(c.endswith(tuple(f"**{v}**" for v in stats.VERDICTS)) for c in cells), row
        else:
            assert len(rows[key]) == 2, key
    for key in stats.SCAN_CHECKS:
        assert key in rows, key
    for n in SCAN:
        assert f"| {n} |" in text


def test_docs_splice_replaces_only_between_the_markers(run):
    doc, data = run["doc"], run["json"]
    assert doc.startswith(DOC_HEAD) and doc.endswith(report.END + DOC_TAIL)
    assert "stale table" not in doc
    inner = doc[len(DOC_HEAD):-len(report.END + DOC_TAIL)]
    assert inner.startswith(report.BEGIN)
    assert inner.startswith(f"{report.BEGIN} by `{data['meta']['command']}` on {data['meta']['date']}:")
    assert f"- command: `{data['meta']['command']}`" in inner and f"- date: {data['meta']['date']}" in inner
    assert "### Results" in inner and "#### Targets" in inner and "#### State mix `transformer`" in inner


def test_splice_unit():
    doc = "before\n" + report.BEGIN + " old -->\nold\n" + report.END + "\nafter\n"
    once = report.splice(doc, "NEW\n", "python -m benchmarks --x", "2026-01-01")
    assert once.startswith("before\n" + report.BEGIN) and once.endswith(report.END + "\nafter\n")
    assert "NEW" in once and "old\n" not in once and "`python -m benchmarks --x` on 2026-01-01" in once
    assert report.splice(once, "NEW\n", "python -m benchmarks --x", "2026-01-01") == once  # idempotent
    twice = report.splice(once, "NEWER\n", "c", "d")
    assert "NEWER" in twice and "NEW\n" not in twice
    mentioned = f"Text about `{report.BEGIN}` and `{report.END}` markers.\n" + doc
    assert report.splice(mentioned, "NEW\n", "python -m benchmarks --x", "2026-01-01") == mentioned.split(doc)[0] + once
    for bad in ("no markers", report.END + "\n" + report.BEGIN + " -->\n", doc + doc, "x " + report.BEGIN + " " + report.END,
                report.BEGIN + " -->\nx " + report.END + "\n"):
        with pytest.raises(ValueError):
            report.splice(bad, "NEW", "c", "d")


def test_docs_without_markers_is_refused_before_the_run(tmp_path):
    doc = tmp_path / "plain.md"
    doc.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="generated markers"):
        cli.main(["--docs", str(doc), "--dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists() and doc.read_text() == "# no markers\n"


@pytest.mark.parametrize(("op", "threshold", "lo", "hi", "want"), [
    # >= : met when it holds over the whole range, not met nowhere, within noise when straddled
    (">=", 0.9, 1.0, 1.2, "met"),
    (">=", 0.9, 0.5, 0.8, "not met"),
    (">=", 0.9, 0.8, 1.0, "within noise"),
    (">=", 0.9, 0.9, 1.0, "met"),            # the low end on the threshold holds
    (">=", 0.9, 0.8, 0.9, "within noise"),   # the high end on it holds, the low end does not
    (">=", 0.9, 0.9, 0.9, "met"),
    (">=", 0.9, 0.89999, 0.89999, "not met"),
    ("<=", 0.1, 0.05, 0.1, "met"),
    ("<=", 0.1, 0.1, 0.2, "within noise"),
    ("<=", 0.1, 0.11, 0.2, "not met"),
    ("<=", 10, -5.0, 3.0, "met"),            # negative overheads are below any positive bound
    ("<", 1.0, 0.2, 0.5, "met"),
    ("<", 1.0, 0.5, 1.0, "within noise"),    # strict: on the threshold does not hold
    ("<", 1.0, 1.0, 1.2, "not met"),
    (">", 2.0, 2.0, 3.0, "within noise"),
])
def test_verdict(op, threshold, lo, hi, want):
    assert verdict(lo, hi, Target(op, threshold, "test")) == want


def test_verdict_rejects_an_empty_range():
    with pytest.raises(ValueError):
        verdict(1.0, 0.5, Target(">=", 0.9, "test"))


def _res(**runs):
    """Synthetic combined results: measurement -> per-repeat slowest-rank seconds."""
    return {k: {"seconds": stats.summary(v), "runs_seconds": v} for k, v in runs.items()}


@pytest.mark.parametrize(("refckpt", "raw", "value", "lo", "hi", "want"), [
    ([1.0, 1.0, 1.0], [1.0, 1.1, 1.2], 1.1, 1.0, 1.2, "met"),         # refckpt at least as fast every time
    ([1.0, 2.0, 0.5], [1.0, 1.0, 1.0], 1.0, 0.5, 2.0, "within noise"),  # ratio of medians 1.0, repeats disagree
    ([2.0, 2.0, 2.2], [1.0, 1.1, 1.0], 0.5, 0.4545, 0.55, "not met"),  # refckpt about half as fast every time
])
def test_ratio_of_medians_with_its_paired_range_and_verdict(refckpt, raw, value, lo, hi, want):
    r = stats.ratios(_res(refckpt_save=refckpt, raw_write=raw), 1, [])["save_vs_raw"]
    assert r["value"] == pytest.approx(value, rel=1e-3)
    assert (r["min"], r["max"]) == (pytest.approx(lo, rel=1e-3), pytest.approx(hi, rel=1e-3))
    assert r["verdict"] == want and r["target"] == ">= 0.9"


def test_ratio_kinds_on_synthetic_numbers():
    res = _res(refckpt_save=[2.0, 4.0, 3.0], refckpt_save_nochecksum=[2.0, 3.2, 3.0],
               refckpt_async_blocked=[0.1, 0.2, 0.6])
    res["refckpt_load"] = {"runs_peak_extra_bytes": [10, 30, 20], "runs_seconds": [1.0, 1.0, 1.0]}
    r = stats.ratios(res, 100, [])
    assert r["checksum_overhead_save_pct"]["value"] == pytest.approx(0.0)  # medians 3.0 and 3.0
    assert (r["checksum_overhead_save_pct"]["min"], r["checksum_overhead_save_pct"]["max"]) == (0.0, pytest.approx(25.0))
    assert r["checksum_overhead_save_pct"]["verdict"] == "within noise"
    assert r["async_blocked_vs_sync"]["value"] == pytest.approx(0.2 / 3.0)
    assert r["async_blocked_vs_sync"]["runs"] == pytest.approx([0.05, 0.05, 0.2])
    assert r["async_blocked_vs_sync"]["verdict"] == "within noise"
    assert r["peak_mem_load_vs_shard"]["value"] == pytest.approx(0.2) and r["peak_mem_load_vs_shard"]["verdict"] == "met"
    assert r["save_vs_dcp"]["value"] is None and r["save_vs_dcp"]["verdict"] is None  # dcp_save not measured


def test_every_target_names_a_known_ratio_or_check_and_its_source():
    assert set(stats.TARGETS) <= set(stats.RATIOS) | set(stats.SCAN_CHECKS)
    assert set(stats.SCAN_CHECKS) <= set(stats.TARGETS)
    assert all(t.source and t.op in (">=", "<=", ">", "<") for t in stats.TARGETS.values())


@pytest.mark.parametrize("mix", list(state.MIXES))
def test_state_size_is_the_total_of_params_and_moments(mix):
    for mib in (2, 64, 1024):
        dims = state.model_dims(mib << 20, mix)
        total = dims["params"] * 4 * 3
        assert abs(total - (mib << 20)) / (mib << 20) < 0.01, (mib, dims)
        if mix == "transformer":
            assert 0.85 <= 2 * dims["vocab"] * dims["d"] / dims["params"] <= 0.97, dims


def test_unknown_mix_is_refused():
    with pytest.raises(ValueError):
        state.model_dims(1 << 20, "tiny")
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--mix", "tiny"])
    assert cli.parser().parse_args([]).mix == "both" and cli.parser().parse_args([]).repeats == 5


@pytest.mark.parametrize("method", ["VmHWM after clear_refs=5", "VmRSS sampled every 1 ms"])
def test_peak_rss_sees_a_transient_allocation(monkeypatch, method):
    import torch

    if method.startswith("VmHWM") and not PeakRSS._reset_hwm():
        pytest.skip("/proc/self/clear_refs is not writable here")
    monkeypatch.setattr(PeakRSS, "method", method)
    mem = PeakRSS().start()
    t = torch.ones(32 << 20, dtype=torch.uint8)  # 32 MiB, every page touched
    if method.startswith("VmRSS"):  # wait until the sampler has seen it (no fixed sleep)
        import time

        deadline = time.monotonic() + 30
        while mem._max - mem.base < 30 << 20 and time.monotonic() < deadline:
            mem._stop.wait(0.001)
    del t
    assert mem.stop() >= 30 << 20


def test_drop_cache_empties_the_page_cache_of_a_file(tmp_path):
    fp = tmp_path / "f.bin"
    fp.write_bytes(os.urandom(4 << 20))
    fp.read_bytes()
    before = resident_bytes(str(fp))
    if before is None or before == 0:
        pytest.skip("mincore cannot see this file's page cache")
    if "tmpfs" in fs_of(str(tmp_path)):
        pytest.skip("tmpfs pages cannot be dropped")
    used, total, resident = drop_cache(str(tmp_path), "fadvise")
    assert (used, total, resident) == ("fadvise", 4 << 20, 0)
