"""``python -m benchmarks`` end to end at a tiny size: every measurement and ratio is reported.

Only the *shape* of the report is checked (every row, every ratio, every JSON field, numbers
where numbers belong), never the timings' values: those depend on the machine and its load.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

from benchmarks import bench

SCAN = [10, 100]

# One worker runs the module and the benchmark run below is session-scoped, so it happens once:
# module scope on spread or interleaved workers measured three full runs per session.
pytestmark = pytest.mark.xdist_group("refckpt-bench")


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One tiny run of the whole benchmark at world sizes 1 and 2, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench")
    out_json = tmp / "bench.json"
    argv = ["--size-mib", "4", "--repeats", "1", "--world-sizes", "1,2", "--scan-steps", ",".join(map(str, SCAN)),
            "--train-steps", "5", "--dir", str(tmp / "runs"), "--json", str(out_json), "--timeout", "300", "--quiet"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = bench.main(argv)
    return {"rc": rc, "text": buf.getvalue(), "json": json.loads(out_json.read_text()), "tmp": tmp, "argv": argv}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def test_exit_code_and_cleanup(run):
    assert run["rc"] == 0
    # every run wrote into a fresh directory under --dir, removed at the end
    assert os.listdir(run["tmp"] / "runs") == []


def test_table_has_every_measurement_ratio_and_header(run):
    text = run["text"]
    for field in ("- date:", "- command: `python -m benchmarks --size-mib 4", "- machine:", " cores", "GiB RAM",
                  "torch ", "- dir:", "file system:", "- page cache before reads:", "posix_fadvise", "- peak memory:"):
        assert field in text, field
    rows = {line.split("|")[1].strip().split(":")[0]: line for line in text.splitlines() if line.startswith("| ")}
    for key in bench.MEASUREMENTS:
        assert key in rows, key
        cells = [c.strip() for c in rows[key].split("|")[2:-1]]
        assert len(cells) == 8, rows[key]  # 4 columns x world sizes 1, 2
        # a time for world size 1 always; at world size 2 only the ws1-only rows are n/a
        assert cells[0] not in ("n/a", ""), rows[key]
        assert (cells[4] == "n/a") == (key in bench.WS1_ONLY), rows[key]
    for key, (_desc, target, _check) in bench.RATIOS.items():
        assert key in rows, key
        assert f"| {target} |" in rows[key], rows[key]
    for key in bench.SCAN_CHECKS:
        assert key in rows, key
    for n in SCAN:
        assert f"| {n} |" in text
    for case in bench.SCAN_CASES:
        assert case in text


def test_json_has_every_raw_number(run):
    data = run["json"]
    assert data["meta"]["command"] == "python -m benchmarks " + " ".join(run["argv"])
    m = data["meta"]["machine"]
    assert _number(m["cores"]) and _number(m["ram_bytes"]) and m["torch"]
    assert data["meta"]["fs"] and data["meta"]["dir"]
    assert data["meta"]["cache_drop_detail"]["methods"] == ["fadvise"]
    assert data["config"]["world_sizes"] == [1, 2]
    for ws in ("1", "2"):
        assert _number(data["state_bytes"][ws]) and data["state_bytes"][ws] > 0
        assert _number(data["largest_shard_bytes"][ws])
        res = data["results"][ws]
        assert set(res) == set(bench.MEASUREMENTS)
        for key, rec in res.items():
            if ws == "2" and key in bench.WS1_ONLY:
                assert rec is None, key
                continue
            assert rec is not None, (ws, key)
            assert _number(rec["seconds"]) and rec["seconds"] > 0, (ws, key)
            assert len(rec["runs_seconds"]) == 1
            assert len(rec["per_rank_seconds"][0]) == int(ws)
            if not key.startswith("train_"):
                assert _number(rec["peak_extra_bytes"]), (ws, key)
            if key.endswith("_save") or key in ("raw_write", "refckpt_async_durable", "refckpt_save_nochecksum"):
                assert rec["disk_bytes"] >= data["state_bytes"][ws] * 0.99, (ws, key)
        ratios = data["ratios"][ws]
        assert set(ratios) == set(bench.RATIOS)
        for key, r in ratios.items():
            if ws == "2" and key == "save_vs_torch_save":
                assert r["value"] is None
                continue
            assert _number(r["value"]), (ws, key, r)
            assert r["target"] == bench.RATIOS[key][1]
            assert (r["ok"] is None) == (bench.RATIOS[key][2] is None)
    fl = data["find_latest"]
    assert sorted(fl, key=int) == [str(n) for n in SCAN]
    for n in SCAN:
        for case in bench.SCAN_CASES:
            assert _number(fl[str(n)][case]["us"]) and fl[str(n)][case]["us"] > 0
    assert set(data["scan_checks"]) == set(bench.SCAN_CHECKS)
    for r in data["scan_checks"].values():
        assert _number(r["value"])


def test_state_size_is_the_total_of_params_and_moments():
    for mib in (4, 64, 1024):
        dims = bench.model_dims(mib << 20)
        total = dims["params"] * 4 * 3
        assert abs(total - (mib << 20)) / (mib << 20) < 0.01, (mib, dims)


@pytest.mark.parametrize("method", ["VmHWM after clear_refs=5", "VmRSS sampled every 1 ms"])
def test_peak_rss_sees_a_transient_allocation(monkeypatch, method):
    import torch

    if method.startswith("VmHWM") and not bench.PeakRSS._reset_hwm():
        pytest.skip("/proc/self/clear_refs is not writable here")
    monkeypatch.setattr(bench.PeakRSS, "method", method)
    mem = bench.PeakRSS().start()
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
    before = bench.resident_bytes(str(fp))
    if before is None or before == 0:
        pytest.skip("mincore cannot see this file's page cache")
    if "tmpfs" in bench._fs_of(str(tmp_path)):
        pytest.skip("tmpfs pages cannot be dropped")
    used, total, resident = bench.drop_cache(str(tmp_path), "fadvise")
    assert (used, total, resident) == ("fadvise", 4 << 20, 0)
