"""The device smoke test (``.ci/device-smoke``, ``faults/smoke.py``) without a device.

Run here for real, as subprocesses: the no-device path (every check a SKIP naming the probe
that found nothing, exit 0; the GPU and NPU workflows' own lines, with ``--require``, exit 1)
and the CPU dry run (``--backend gloo``: every check's code path on CPU tensors, bitwise).
The backend choice, the verdict and the pinned-staging judgement are checked with injected probe
results, outcomes and counts; the bitwise comparison with a flipped bit; a rank that dies with a
fresh world for the next check; and both device workflows are read to check that they run the
smoke test right after checking their devices and before ``.ci/run-tests``.

The script's runs (four fresh interpreters, one with a spawned world: about 20 CPU s) are in the
extended profile, which ``.ci/run`` runs after `pytest -n 8`; the injected-probe checks stay in the
default run.

Nothing here has run on a GPU or NPU: on a machine with one, the no-device runs skip.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml

from faults import smoke
from faults.backends import GLOO, HCCL, NCCL
from faults.smoke import CHECKS, Probe, Result, choose_backend, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = os.path.join(ROOT, ".github", "workflows")
SMOKE_RE = re.compile(r"^\s*bash \.ci/device-smoke (?P<args>.*)$", re.M)
TESTS_RE = re.compile(r"^\s*bash \.ci/run-tests ", re.M)
DEVICE_WORKFLOWS = {"ci-gpu.yml": ("nccl", "torch.cuda.device_count()"),
                    "ci-npu.yml": ("hccl", "torch.npu.device_count()")}
NO_DEVICE = "no CUDA device (torch.cuda.device_count() == 0) and no torch_npu (import torch_npu: "
LINE_RE = re.compile(r"^(PASS|FAIL|SKIP) (?P<check>[a-z0-9-]+): (?P<detail>.+)$")
# every run shares one xdist worker, so the module's subprocesses start once, side by side
pytestmark = pytest.mark.xdist_group("device_smoke")


def _steps(workflow: str) -> list[dict]:
    with open(os.path.join(WORKFLOWS, workflow), encoding="utf-8") as f:
        (job,) = yaml.safe_load(f)["jobs"].values()
    return job["steps"]


def _smoke_args(workflow: str) -> list[list[str]]:
    return [shlex.split(m["args"]) for s in _steps(workflow) for m in SMOKE_RE.finditer(s.get("run", ""))]


def _devices_here() -> bool:
    """Whether this machine has a CUDA device or torch_npu, asked of torch directly."""
    import importlib.util

    import torch

    return torch.cuda.device_count() > 0 or importlib.util.find_spec("torch_npu") is not None


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.Popen(["bash", ".ci/device-smoke", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


class _Runs:
    """The script's runs, started together; :meth:`get` waits for one: (exit code, stdout lines,
    stderr). The tests in this process run meanwhile."""

    def __init__(self, start: bool) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, tuple[int, list[str], str]] = {}
        if not start:
            return
        self.procs["dry-run"] = _start("--backend", "gloo", "--bench-mib", "4")
        if not _devices_here():
            self.procs["default"] = _start()
            for wf in DEVICE_WORKFLOWS:
                (args,) = _smoke_args(wf)
                self.procs[wf] = _start(*args)

    def get(self, name: str) -> tuple[int, list[str], str]:
        if name not in self.procs:  # pragma: no cover - device runners (the workflow runs the script itself)
            pytest.skip("this machine has a CUDA device or torch_npu: the no-device path does not apply")
        if name not in self.done:
            p = self.procs[name]
            stdout, stderr = p.communicate(timeout=240)
            self.done[name] = (p.returncode, stdout.splitlines(), stderr)
        return self.done[name]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:  # pragma: no cover - only after a failure or timeout
                p.kill()
                p.communicate()


@pytest.fixture(scope="module", autouse=True)
def runs(request) -> Iterator[_Runs]:
    """Started with the module's first test, if a selected test asks for them (``-k`` may leave none)."""
    wanted = any(item.module is sys.modules[__name__] and "runs" in inspect.signature(item.function).parameters
                 and item.get_closest_marker("skip") is None
                 for item in request.session.items if isinstance(item, pytest.Function))
    started = _Runs(wanted)
    try:
        yield started
    finally:
        started.stop()


def _assert_all_skipped(lines: list[str], reason: str, stderr: str) -> None:
    assert len(lines) == len(CHECKS) + 1, "\n".join(lines) + stderr
    for check, line in zip(CHECKS, lines):
        assert line == f"SKIP {check}: {reason}", "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The logic, with injected probes and outcomes
# ---------------------------------------------------------------------------------------

NO_NPU = "no torch_npu (import torch_npu: ModuleNotFoundError: No module named 'torch_npu')"
CPU_BUILD = "this torch is not a CUDA build (torch.version.cuda is None)"
NONE = Probe(cuda_count=0, nccl_available=False, npu_imported=False, npu_count=0,
             npu_error="ModuleNotFoundError: No module named 'torch_npu'")
GPU = Probe(cuda_count=2, nccl_available=True, cuda_build="12.8")
NPU = Probe(cuda_count=0, nccl_available=False, npu_imported=True, npu_count=8)


@pytest.mark.parametrize(
    ("requested", "probe", "choice", "reason"),
    [
        ("nccl", GPU, NCCL, ""),
        ("auto", GPU, NCCL, ""),
        ("auto", Probe(1, True, "12.8", npu_imported=True, npu_count=8), NCCL, ""),  # CUDA first
        ("hccl", NPU, HCCL, ""),
        ("auto", NPU, HCCL, ""),
        ("gloo", GPU, GLOO, ""),
        ("nccl", NONE, None, f"no CUDA device (torch.cuda.device_count() == 0); {CPU_BUILD}"),
        ("nccl", Probe(0, True, "12.8"), None, "no CUDA device (torch.cuda.device_count() == 0)"),
        ("nccl", Probe(2, False, "12.8"), None,
         "2 CUDA device(s) but no NCCL (torch.distributed.is_nccl_available() is False)"),
        ("nccl", NPU, None, f"no CUDA device (torch.cuda.device_count() == 0); {CPU_BUILD}"),
        ("hccl", GPU, None, "no torch_npu (import torch_npu: not probed)"),
        ("hccl", NONE, None, NO_NPU),
        ("hccl", Probe(0, False, npu_imported=True, npu_count=0), None,
         "torch_npu sees no NPU (torch.npu.device_count() == 0)"),
        ("hccl", Probe(0, False, npu_imported=True, npu_count=0, npu_error="RuntimeError: driver"), None,
         "torch_npu sees no NPU (torch.npu.device_count() == 0: RuntimeError: driver)"),
        ("auto", NONE, None, f"no CUDA device (torch.cuda.device_count() == 0) and {NO_NPU}; {CPU_BUILD}"),
        ("auto", Probe(0, True, "12.8", npu_imported=True, npu_count=0), None,
         "no CUDA device (torch.cuda.device_count() == 0) and torch_npu sees no NPU (torch.npu.device_count() == 0)"),
    ],
)
def test_choose_backend_from_injected_probes(requested, probe, choice, reason) -> None:
    assert choose_backend(requested, probe) == (choice, reason)


def test_choose_backend_rejects_unknown_backends() -> None:
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        choose_backend("cuda", GPU)


def _results(**status: str) -> list[Result]:
    """Every check PASS, but those named (dashes as underscores) get the status given."""
    return [Result(c, status.get(c.replace("-", "_"), "PASS"), "detail") for c in CHECKS]


@pytest.mark.parametrize(
    ("results", "require", "on_device", "final", "code"),
    [
        (_results(), True, True, "device-smoke OK: 8 passed, 0 failed, 0 skipped", 0),
        (_results(), False, True, "device-smoke OK: 8 passed, 0 failed, 0 skipped", 0),
        (_results(deferred_save="SKIP"), True, True, "device-smoke OK: 7 passed, 0 failed, 1 skipped", 0),
        (_results(fsdp2="FAIL"), False, True, "device-smoke FAILED: 7 passed, 1 failed, 0 skipped (failed: fsdp2)", 1),
        (_results(world="FAIL", bench_load="FAIL"), True, True,
         "device-smoke FAILED: 6 passed, 2 failed, 0 skipped (failed: world, bench-load)", 1),
        (_results(pinned_staging="SKIP"), True, True,
         "device-smoke FAILED: --require, but pinned-staging did not run: 7 passed, 0 failed, 1 skipped", 1),
        (_results(pinned_staging="SKIP"), False, True, "device-smoke OK: 7 passed, 0 failed, 1 skipped", 0),
        (_results()[:-1], True, True, "device-smoke FAILED: --require, but bench-load did not run: 7 passed, 0 failed, "
                                      "0 skipped", 1),
        (smoke.skip_all("no device"), False, False, "device-smoke OK: 0 passed, 0 failed, 8 skipped (no device "
                                                    "checked; --require makes this a failure)", 0),
        (smoke.skip_all("no device"), True, False, "device-smoke FAILED: --require, but no device check ran: 0 passed, "
                                                   "0 failed, 8 skipped", 1),
        # the CPU dry run never satisfies --require, however well it went
        (_results(pinned_staging="SKIP"), True, False, "device-smoke FAILED: --require, but no device check ran: "
                                                       "7 passed, 0 failed, 1 skipped", 1),
    ],
)
def test_verdict(results, require, on_device, final, code) -> None:
    assert verdict(results, require=require, on_device=on_device) == (final, code)


def test_a_result_is_one_line_with_a_known_status() -> None:
    assert Result("fsdp2", "FAIL", "rank 0 raised\n  Traceback ...").line() == "FAIL fsdp2: rank 0 raised Traceback ..."
    with pytest.raises(ValueError, match="status must be one of"):
        Result("fsdp2", "OK", "")


def test_the_comparison_is_bitwise_and_names_what_differs() -> None:
    """What every save check rests on: a flipped bit in one moment fails it, naming the tensor;
    0.0 and -0.0 differ (``torch.equal`` says they are equal); NaN equals the same NaN."""
    import torch

    cpu = torch.device("cpu")
    assert not smoke._same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert smoke._same_bits(torch.tensor(float("nan")), torch.tensor(float("nan")))
    assert not smoke._same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    model, opt = smoke._build(0, cpu)
    smoke._train(model, opt, range(2), cpu)
    expected = smoke._snapshot(model, opt)
    assert "bitwise equal to the save call" in smoke._compare(expected, model, opt, cpu)
    key = next(k for k in expected if k.endswith(".exp_avg_sq"))
    smoke._tensors(model, opt)[key].view(-1).view(torch.int32)[5] ^= 1
    with pytest.raises(smoke._Failed, match=rf"1 tensor\(s\) differ bitwise .*{re.escape(key)}"):
        smoke._compare(expected, model, opt, cpu)
    # and a check that raises reports FAIL for each of its checks, with where it was raised
    out = smoke._guarded(("a", "b"), lambda: [("a", "PASS", smoke._compare(expected, model, opt, cpu))])
    assert [(c, s) for c, s, _ in out] == [("a", "FAIL"), ("b", "FAIL")] and "differ bitwise" in out[0][2]

    def broken() -> list[tuple[str, str, str]]:
        raise ZeroDivisionError("division by zero")

    out = smoke._guarded(("a",), broken)
    assert out[0][2].startswith("ZeroDivisionError: division by zero (at test_device_smoke.py:")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, in one process without a group
def test_staging_counts_see_one_buffer_per_saved_tensor(tmp_path) -> None:
    """The count ``pinned-staging`` judges, read off a real async save here (no process group, CPU
    tensors: nothing pinned): the stager keeps one buffer per tensor of the state."""
    import torch

    from refckpt import DistributedCheckpointer, get_training_state

    cpu = torch.device("cpu")
    model, opt = smoke._build(0, cpu)
    smoke._train(model, opt, range(1), cpu)
    state = get_training_state(model, opt, {"global_step": 1})
    ckpt = DistributedCheckpointer()
    try:
        ckpt.save(str(tmp_path), state, global_step=1, save_async=True)
        ckpt.maybe_wait_for_async_save()
        counts = smoke.staging_counts(ckpt, state)
    finally:
        ckpt.close()
    # 4 parameters, and for each a step and two moments
    assert counts == {"buffers": 16, "pinned": 0, "pinned_bytes": 0, "tensors": 16, "on_device": 0}
    assert smoke.judge_staging(counts, "cpu")[0] == "SKIP"
    with pytest.raises(smoke._Failed, match="no _stager._bufs"):
        smoke.staging_counts(object(), state)


def test_a_crashed_rank_fails_its_checks_and_a_fresh_world_runs_the_next(tmp_path, capsys) -> None:
    """The parent side: a rank that dies (``os._exit(3)`` as the rank function) fails the checks of
    its run, naming the death; the next run gets a fresh world and passes; a run that reports
    nothing for a check still gets its line, a FAIL."""
    plan: list[smoke.Run] = [(("crash",), os._exit, (3,)), (("world",), smoke.rank_world, ("gloo",)),
                             (("silent",), smoke.rank_world, ("gloo",))]
    results = smoke.run_checks(GLOO, workdir=str(tmp_path), bench_mib=1, budget_s=120, runs=plan)
    assert [(r.check, r.status) for r in results] == [("crash", "FAIL"), ("world", "PASS"), ("silent", "FAIL")]
    assert results[0].detail.startswith("RankDied: ") and "exit code 3" in results[0].detail, results[0]
    assert results[1].detail.startswith("1-rank gloo world on cpu, torch ")
    assert results[2].detail == "rank_world reported no result for it"
    assert capsys.readouterr().out.splitlines() == [r.line() for r in results]


@pytest.mark.parametrize(
    ("counts", "status", "detail"),
    [
        ({"buffers": 12, "pinned": 8, "pinned_bytes": 4096, "tensors": 12, "on_device": 8}, "PASS",
         "the 8 staging buffers of the 8 cuda tensors are pinned host memory (tensor.is_pinned(), 4 KiB); "
         "4 CPU tensor(s)' buffers unpinned"),
        ({"buffers": 12, "pinned": 0, "pinned_bytes": 0, "tensors": 12, "on_device": 8}, "FAIL",
         "0 of 12 staging buffers pinned for 8 cuda tensors (12 tensors saved)"),
        ({"buffers": 12, "pinned": 12, "pinned_bytes": 1, "tensors": 12, "on_device": 8}, "FAIL",
         "12 of 12 staging buffers pinned for 8 cuda tensors (12 tensors saved)"),
        ({"buffers": 0, "pinned": 0, "pinned_bytes": 0, "tensors": 12, "on_device": 8}, "FAIL",
         "0 of 0 staging buffers pinned for 8 cuda tensors (12 tensors saved)"),
        ({"buffers": 12, "pinned": 0, "pinned_bytes": 0, "tensors": 12, "on_device": 0}, "FAIL",
         "the saved state has no tensor on cuda"),
    ],
)
def test_judge_staging_from_injected_counts(counts, status, detail) -> None:
    assert smoke.judge_staging(counts, "cuda") == (status, detail)


# ---------------------------------------------------------------------------------------
# The workflows
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("workflow", list(DEVICE_WORKFLOWS))
def test_device_workflow_runs_the_smoke_test_after_its_device_check_and_before_the_tests(workflow: str) -> None:
    backend, probe = DEVICE_WORKFLOWS[workflow]
    runs = [s.get("run", "") for s in _steps(workflow)]
    assert _smoke_args(workflow) == [["--backend", backend, "--require"]]
    smoke_at = next(i for i, r in enumerate(runs) if SMOKE_RE.search(r))
    check_at = next(i for i, r in enumerate(runs) if probe in r and "assert n >= 1" in r)
    tests_at = [i for i, r in enumerate(runs) if TESTS_RE.search(r)]
    assert tests_at and check_at + 1 == smoke_at < min(tests_at), runs
    step = _steps(workflow)[smoke_at]
    assert 0 < step["timeout-minutes"] <= 10
    if backend == "hccl":  # torch_npu needs CANN's environment in the same shell
        assert runs[smoke_at].splitlines() == ['source "$CANN_SET_ENV"', "bash .ci/device-smoke --backend hccl --require"]
    else:
        assert runs[smoke_at].strip() == "bash .ci/device-smoke --backend nccl --require"


def test_the_script_is_executable_and_runs_the_module() -> None:
    path = os.path.join(ROOT, ".ci", "device-smoke")
    assert os.access(path, os.X_OK)
    with open(path, encoding="utf-8") as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', 'exec python -m faults.smoke "$@"']


# ---------------------------------------------------------------------------------------
# The script, run here
# ---------------------------------------------------------------------------------------


@pytest.mark.extended  # a run of .ci/device-smoke: see the module docstring
def test_without_a_device_every_check_skips_naming_the_probes(runs) -> None:
    code, lines, stderr = runs.get("default")
    assert code == 0, "\n".join(lines) + stderr
    reason = lines[0].split(": ", 1)[1]
    assert reason.startswith(NO_DEVICE), reason
    _assert_all_skipped(lines, reason, stderr)
    assert lines[-1] == (f"device-smoke OK: 0 passed, 0 failed, {len(CHECKS)} skipped "
                         f"(no device checked; --require makes this a failure)")


@pytest.mark.extended  # a run of .ci/device-smoke: see the module docstring
@pytest.mark.parametrize("workflow", list(DEVICE_WORKFLOWS))
def test_the_workflows_line_fails_here_with_require(runs, workflow: str) -> None:
    """The GPU / NPU job's own line: its backend's probe named on every check, then exit 1."""
    code, lines, stderr = runs.get(workflow)
    assert code == 1, "\n".join(lines) + stderr
    reason = ("no CUDA device (torch.cuda.device_count() == 0)" if DEVICE_WORKFLOWS[workflow][0] == "nccl"
              else "no torch_npu (import torch_npu: ModuleNotFoundError: No module named 'torch_npu')")
    assert lines[0].split(": ", 1)[1].startswith(reason), lines[0]
    if workflow == "ci-gpu.yml":  # asked for nccl only: torch_npu is not probed
        assert "torch_npu" not in "\n".join(lines)
    _assert_all_skipped(lines, lines[0].split(": ", 1)[1], stderr)
    assert lines[-1] == f"device-smoke FAILED: --require, but no device check ran: 0 passed, 0 failed, {len(CHECKS)} skipped"


@pytest.mark.extended  # a run of .ci/device-smoke: see the module docstring
def test_dry_run_on_cpu_passes_every_check_that_cpu_can_run(runs) -> None:
    """``--backend gloo``: the checks' own code on CPU tensors in a real 1-rank world -- saves,
    loads and bitwise comparisons, FSDP2, the benchmark -- all pass; pinned staging skips."""
    code, lines, stderr = runs.get("dry-run")
    assert code == 0, "\n".join(lines) + stderr
    assert len(lines) == len(CHECKS) + 1, "\n".join(lines) + stderr
    parsed = [LINE_RE.match(line) for line in lines[:-1]]
    assert all(parsed), "\n".join(lines)
    status = {m["check"]: (m.group(1), m["detail"]) for m in parsed if m}
    assert list(status) == list(CHECKS)
    assert status["pinned-staging"] == ("SKIP", "CPU tensors (gloo dry run): refckpt pins staging buffers for device "
                                                "tensors only")
    deferred = smoke.deferred_unavailable()
    assert status["deferred-save"][0] == ("SKIP" if deferred else "PASS"), status["deferred-save"]
    for check in ("world", "sync-save", "async-save", "fsdp2", "bench-save", "bench-load"):
        assert status[check][0] == "PASS", lines
    for check in ("sync-save", "async-save", "fsdp2"):
        assert re.search(r"4 params \+ 8 moments on cpu \(and \d+ other\) bitwise equal to the save call",
                         status[check][1]), status[check]
    assert re.search(r"4 MiB in [\d.]+ s = [\d.]+ GB/s cpu -> disk", status["bench-save"][1])
    assert re.search(r"4 MiB in [\d.]+ s = [\d.]+ GB/s disk -> cpu, bitwise equal", status["bench-load"][1])
    passed = len(CHECKS) - 1 - bool(deferred)
    assert re.fullmatch(rf"device-smoke OK: {passed} passed, 0 failed, {len(CHECKS) - passed} skipped \(no device "
                        rf"checked; --require makes this a failure\) \[gloo on cpu, [\d.]+ s\]", lines[-1]), lines[-1]
