"""``python -m benchmarks.scale`` at world sizes 1, 8 and 64, its model checked against the real thing,
and its growth-class fitting on synthetic numbers.

The run (in this process, about 15 s on an idle 2-core machine) checks the report's *shape*: a row per
world size with every figure, files per step = N shards + N extra-state files + the record, a commit
record that grows with N, a growth class for every figure, the docs splice. Timings are never
compared with each other: they depend on the machine and its load. What the model stands on is
checked against DCP and refckpt themselves: the mirrored local plans against DCP's own planner on
DTensors under the fake process group, for every rank of a world with uneven and empty chunks; the
modelled write results and commit record of world size 1 against a real ``DistributedCheckpointer``
save of the same state. The growth classes are checked on synthetic series, so the fitting can fail.
The tests that read the run (about 13 CPU s of `pytest -n 8` on 2 cores) are in the extended profile
(``.ci/run`` runs it after `pytest -n 8`); the model and fitting checks stay in the default run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import random
import warnings

import pytest

from benchmarks import scale

SIZES = [1, 8, 64]
DOC_HEAD = "# Scale\n\nHand-written method. Keep me.\n\n"
DOC_TAIL = "\n\n## Findings\n\nHand-written tail. Keep me too.\n"
TINY = scale.ModelSpec(layers=1, dim=16, ffn=24, vocab=40)

# The run happens once per session: the first xdist worker to need it runs it under a file lock in
# the session's shared temporary directory, the others read what it left there.
pytestmark = pytest.mark.xdist_group("refckpt-scale")


def _run_scale(tmp) -> None:
    doc = tmp / "scale.md"
    doc.write_text(DOC_HEAD + f"{scale.BEGIN} -->\nstale table\n{scale.END}" + DOC_TAIL)
    argv = ["--world-sizes", ",".join(map(str, SIZES)), "--in-process", "--trace-max", "8", "--quiet",
            "--dir", str(tmp), "--json", str(tmp / "scale.json"), "--docs", str(doc)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = scale.main(argv)
    (tmp / "stdout.md").write_text(buf.getvalue())
    (tmp / "done.json").write_text(json.dumps({"rc": rc, "argv": argv}))


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One run at world sizes 1, 8 and 64 (about 15 s on an idle 2-core machine), shared by the tests below."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    tmp = shared / "refckpt-scale-run"
    tmp.mkdir(exist_ok=True)
    with open(shared / "refckpt-scale-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tmp / "done.json").exists():
            _run_scale(tmp)
    done = json.loads((tmp / "done.json").read_text())
    assert done["rc"] == 0
    return {"report": json.loads((tmp / "scale.json").read_text()), "stdout": (tmp / "stdout.md").read_text(),
            "doc": (tmp / "scale.md").read_text(), "argv": done["argv"]}


@pytest.mark.extended  # uses the end-to-end run: see the module docstring
def test_rows_have_every_figure(run):
    rows = run["report"]["rows"]
    assert [r["n"] for r in rows] == SIZES
    for r in rows:
        for key, *_ in scale.FIGURES:
            if key == "coord_peak_traced" and r["n"] > run["report"]["trace_max"]:
                continue
            assert isinstance(r.get(key), (int, float)), (r["n"], key)
            assert r[key] >= 0, (r["n"], key)
        assert r["local_plan_items"] == 3 * len(scale.ModelSpec().params()) + len(scale.ModelSpec().params()) + 12


@pytest.mark.extended  # uses the end-to-end run: see the module docstring
def test_files_per_step_are_shards_extras_and_record(run):
    for r in run["report"]["rows"]:
        n = r["n"]
        assert (r["shards"], r["extra_files"]) == (n, n)
        assert r["files_per_step"] == r["shards"] + r["extra_files"] + 1 == 2 * n + 1
        assert r["verify_files"] == 2 * n


@pytest.mark.extended  # uses the end-to-end run: see the module docstring
def test_record_grows_with_ranks(run):
    rows = run["report"]["rows"]
    sizes = [r["record_bytes"] for r in rows]
    assert all(a < b for a, b in zip(sizes, sizes[1:])), sizes
    # every rank is sent the Metadata finish() leaves to DCP's broadcast: emptied once the record is
    # written, a few hundred bytes whatever the world size (it was the whole record, 119 MiB at 4096)
    assert all(r["bcast_bytes"] < 1024 for r in rows)
    assert max(r["bcast_bytes"] for r in rows) - min(r["bcast_bytes"] for r in rows) < 16
    # refckpt's outcome check all-reduces one int32 when all is well (it all-gathered N objects)
    assert {r["outcome_bytes"] for r in rows} == {4}
    # what a rank sends does not grow with the world
    sent = [r["plan_sent_bytes"] for r in rows]
    assert max(sent) < 1.1 * min(sent)


@pytest.mark.extended  # uses the end-to-end run: see the module docstring
def test_report_tables_and_growth(run):
    out, report = run["stdout"], run["report"]
    for title in ("Coordinator and readers", "Every other rank", "Where the time goes", "Growth classes"):
        assert f"# {title}" in out
    tables: list[list[str]] = []
    prev = ""
    for line in out.splitlines():
        if line.startswith("|"):
            if not prev.startswith("|"):
                tables.append([])
            tables[-1].append(line)
        prev = line
    assert len(tables) == 4
    for table in tables:  # a header, its separator, rows as wide as the header
        assert set(table[1].strip("|").split("|")) <= {"---", "---:"}
        assert {line.count("|") for line in table} == {table[0].count("|")}
    for table in tables[:3]:  # one row per world size, in order
        assert [line.split("|")[1].strip() for line in table[2:]] == [str(n) for n in SIZES]
    assert len(tables[3]) == 2 + len(scale.FIGURES)
    growth = {g["key"]: g for g in report["growth"]}
    assert set(growth) == {key for key, *_ in scale.FIGURES}
    assert growth["files_per_step"]["label"] == "O(N)"
    assert growth["record_bytes"]["label"] == "O(N)"
    assert growth["plan_sent_bytes"]["label"] == "O(1)" and not growth["plan_sent_bytes"]["flag"]
    # fixed: constant on every rank. Sizes only: a time's growth class is for the benchmark's table
    # (a loaded machine moves it), never a test's verdict.
    for key in ("bcast_bytes", "outcome_bytes"):
        assert growth[key]["label"] == "O(1)" and not growth[key]["flag"], (key, growth[key])
    # DCP's plan validation, replaced by refckpt's check: quadratic in its overlap checks (3 w2-like
    # tensors per block), reported for reference and never a finding
    assert growth["overlap_checks_dcp"]["label"] == "O(N^2)" and not growth["overlap_checks_dcp"]["flag"]
    layers = report["model"]["layers"]
    assert [r["overlap_checks_dcp"] for r in report["rows"]] == [3 * layers * n * (n - 1) // 2 for n in SIZES]
    # the planner's time is refckpt's planner's, its check included
    assert all(0 < r["check_s"] < r["plan_s"] for r in report["rows"])
    for g in report["growth"]:
        measured = [r for r in report["rows"] if r.get(g["key"]) is not None]
        assert len(g["ratios"]) == len(measured) - 1
        assert f"| {g['what']} | {g['side']} | {g['label']} |" in out


@pytest.mark.extended  # uses the end-to-end run: see the module docstring
def test_docs_splice_keeps_the_hand_written_text(run):
    doc = run["doc"]
    assert doc.startswith(DOC_HEAD + scale.BEGIN + " by `python -m benchmarks.scale --world-sizes 1,8,64")
    assert doc.endswith(scale.END + DOC_TAIL)
    assert "stale table" not in doc
    assert "### Growth classes" in doc  # one heading level down in the docs


def test_docs_without_markers_refused_before_the_run(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("# no markers\n")
    with pytest.raises(ValueError, match="BEGIN GENERATED"):
        scale.main(["--world-sizes", "1", "--docs", str(bad), "--quiet"])
    assert bad.read_text() == "# no markers\n"


# -- the model against DCP and refckpt ---------------------------------------------------------------
@pytest.mark.parametrize("n", [5, 32])
def test_mirrored_plans_are_dcps_for_every_rank(n):
    """Uneven chunks (40 rows over 32 ranks: 2 each, then empty ones) included."""
    template = scale.real_local_plan(TINY, n, 0, repeats=1)["plan"]
    for r in range(n):
        real = scale.real_local_plan(TINY, n, r, repeats=1)["plan"]
        mirror = scale.mirror_plan(template, n, r)
        assert mirror.items == real.items, r
        assert mirror.planner_data == real.planner_data


def test_overlap_checks_counted_as_dcp_makes_them(monkeypatch):
    """The replica's count of overlap checks is the number of ``_check_box_overlap`` calls DCP's own
    ``_validate_global_plan`` makes on the same global plan: N(N-1)/2 for every tensor cut along a
    dimension smaller than another (w2 and its two moments), none for the others."""
    from torch.distributed.checkpoint import default_planner

    n, spec = 64, scale.ModelSpec()
    template = scale.real_local_plan(spec, n, 0, repeats=1)["plan"]
    plans = [scale.mirror_plan(template, n, r) for r in range(n)]
    gp = scale.global_plan(plans, full_validate_max=0)
    calls = 0
    real = default_planner._check_box_overlap

    def counting(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(default_planner, "_check_box_overlap", counting)
    assert default_planner._validate_global_plan(gp["plan"], gp["metadata"]) == []
    assert calls == gp["pairs_dcp"] == 3 * spec.layers * n * (n - 1) // 2
    # what the benchmark times is refckpt's planner: it makes no such check, and plans as DCP does
    from refckpt.planner import RefSavePlanner
    from refckpt.storage.writer import SafetensorsWriter

    calls = 0
    ours = RefSavePlanner().create_global_plan(plans)
    assert calls == 0
    assert SafetensorsWriter("/nonexistent").prepare_global_plan(ours[0]) == gp["plan"] and ours[1] == gp["metadata"]


def test_shard_rows_tile_like_torch_chunk():
    import torch

    for d0 in (1, 7, 40, 4096, 11008):
        for n in (1, 3, 8, 64, 4096):
            got = [scale.shard_rows(d0, n, r) for r in range(n)]
            sizes = [t.shape[0] for t in torch.arange(d0).chunk(n)]
            assert [s for s, _ in got if s] == sizes
            assert sum(s for s, _ in got) == d0
            assert all(off == d0 for s, off in got if not s)


def _module(params):
    """A module whose parameters are ``params`` (dotted names, shapes), zero-filled."""
    import torch

    root = torch.nn.Module()
    for fqn, shape in params:
        *path, name = fqn.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    return root


def test_modelled_record_matches_a_real_save(tmp_path):
    """World size 1: the modelled plan, write results and commit record against a real save of the
    state ``refckpt.get_training_state`` takes from a model with the same parameters and AdamW: the
    same tensors and chunks, the same storage entries at the same offsets, the same files at the same
    sizes and checksum blocks; the record's size within 3% (the checksums differ, and with them how
    many bytes each pickles to; a DTensor's items share sub-objects otherwise than a plain tensor's,
    which the pickle's memo sees; the step directory's path is recorded)."""
    import torch

    from refckpt import DistributedCheckpointer, find_latest_checkpoint, get_training_state
    from refckpt.record import Manifest
    from refckpt.safeload import load_record
    from refckpt.storage.writer import SafetensorsWriter

    model = _module(TINY.params())
    group = {k: v for k, v in scale.PARAM_GROUP.items() if k in ("lr", "betas", "eps", "weight_decay")}
    opt = torch.optim.AdamW(model.parameters(), **group)
    extra = torch.load(io.BytesIO(scale.extra_state_bytes()), weights_only=True)
    state = get_training_state(model, [opt], extra)
    with warnings.catch_warnings():  # DCP warns that this process has no process group: intended
        warnings.simplefilter("ignore")
        DistributedCheckpointer().save(tmp_path / "real", state, global_step=1)
    real_md, _ = load_record(os.path.join(find_latest_checkpoint(str(tmp_path / "real")), ".metadata"))

    lp = scale.real_local_plan(TINY, 1, 0, repeats=1)
    gp = scale.global_plan([scale.mirror_plan(lp["plan"], 1, 0)], full_validate_max=1)
    results = [scale.rank_results(gp["plan"][0], 0, lp["byte_len"], len(scale.extra_state_bytes()), random.Random(0))]
    os.makedirs(tmp_path / "model")
    writer = SafetensorsWriter(str(tmp_path / "model"), sync_files=False, manifest_extra={
        "world_size": 1, "global_step": 1, "extra_state": "per_rank", "writer": "0" * 16})
    writer.set_up_storage_writer(True, rank=0)
    writer.finish(gp["metadata"], results)
    model_md, _ = load_record(str(tmp_path / "model" / ".metadata"))

    assert model_md.state_dict_metadata == real_md.state_dict_metadata
    assert model_md.storage_data == real_md.storage_data
    real_files = {k: v.size for k, v in Manifest.of(real_md, "real").files.items()}
    model_files = {k: v.size for k, v in Manifest.of(model_md, "model").files.items()}
    assert model_files == real_files
    blocks = {k: [c[:2] for c in v.chunks] for k, v in Manifest.of(model_md, "model").files.items()}
    assert blocks == {k: [c[:2] for c in v.chunks] for k, v in Manifest.of(real_md, "real").files.items()}
    assert len(pickle.dumps(model_md.storage_data)) == len(pickle.dumps(real_md.storage_data))
    real_size = os.path.getsize(os.path.join(find_latest_checkpoint(str(tmp_path / "real")), ".metadata"))
    assert abs(os.path.getsize(tmp_path / "model" / ".metadata") - real_size) < 0.03 * real_size


# -- growth classes on synthetic numbers ------------------------------------------------------------
NS = scale.DEFAULT_WORLD_SIZES


def _series(fn, noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    return [fn(n) * (1 + rng.uniform(-noise, noise)) for n in NS]


@pytest.mark.parametrize("fn, label", [
    (lambda n: 5.0, "O(1)"),
    (lambda n: 100.0 + 0.001 * n, "O(1)"),                      # grows, but by less than 25% overall
    (lambda n: 0.3 + 2e-3 * n, "O(N)"),
    (lambda n: 7 * n, "O(N)"),
    (lambda n: 1.0 + 1e-3 * n * math.log2(n), "O(N log N)"),
    (lambda n: 0.01 + 1e-4 * n ** 1.5, "O(N^1.5)"),
    (lambda n: 0.5 + 1e-6 * n * n, "O(N^2)"),
    (lambda n: 0.1 + 1e-8 * n ** 3, "worse than O(N^2)"),
    (lambda n: 1.0 + math.sqrt(n), "sublinear"),
    (lambda n: 10.0 / n, "O(1)"),                                 # shrinking
])
def test_growth_class_on_synthetic_series(fn, label):
    g = scale.growth_class(NS, _series(fn))
    assert g["label"] == label, (g, label)


def test_growth_class_tolerates_noise_and_flags():
    lin = scale.growth_class(NS, _series(lambda n: 0.2 + 1e-3 * n, noise=0.03))
    assert lin["label"] == "O(N)" and lin["grows"] and not lin["superlinear"]
    quad = scale.growth_class(NS, _series(lambda n: 0.2 + 1e-6 * n * n, noise=0.03))
    assert quad["label"] == "O(N^2)" and quad["superlinear"]
    flat = scale.growth_class(NS, _series(lambda n: 0.02, noise=0.1))
    assert flat["label"] == "O(1)" and not flat["grows"]
    # three sizes are enough; the ratios are those of successive values
    g = scale.growth_class([1, 8, 64], [1.0, 8.0, 64.0])
    assert g["label"] == "O(N)" and g["ratios"] == [8.0, 8.0]
    assert scale.growth_class([1, 8], [1.0, 8.0])["label"] == "n/a"
    assert scale.growth_class(NS, [None, 1.0, 8.0, 64.0, 512.0])["label"] == "O(N)"


def test_analyse_flags_by_side():
    rows = [{"n": n, **{key: None for key, *_ in scale.FIGURES}} for n in NS]
    for r in rows:
        r["record_bytes"] = 1000 + 10 * r["n"]                    # coordinator, linear: no finding
        r["plan_s"] = 0.1 + 1e-6 * r["n"] ** 2                    # coordinator, quadratic: a finding
        r["bcast_bytes"] = 1000 + 10 * r["n"]                     # every rank, linear: a finding
        r["plan_sent_bytes"] = 5000.0                             # every rank, constant: no finding
        r["validate_s"] = 0.1 + 1e-6 * r["n"] ** 2                # replaced (not run), quadratic: no finding
    flags = {a["key"]: a["flag"] for a in scale.analyse(rows)}
    assert flags["record_bytes"] is False and flags["plan_s"] is True and flags["validate_s"] is False
    assert flags["bcast_bytes"] is True and flags["plan_sent_bytes"] is False
