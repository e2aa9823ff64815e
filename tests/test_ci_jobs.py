"""The CI jobs: the GitHub workflows call ``.ci/run-tests`` with their backend, and the very
lines they run work here -- on gloo, and as written (nccl, hccl), where they must skip with
the reason on a machine without the devices.

Nothing here has run on a GPU or NPU runner; what it proves is that each job asks for the
right backend and that its command lines are valid.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = os.path.join(ROOT, ".github", "workflows")
SCRIPT = ".ci/run-tests"
CALL_RE = re.compile(r"^\s*bash \.ci/run-tests (?P<args>.*)$", re.M)
CANN_RE = re.compile(r'^\s*source "\$CANN_SET_ENV"\s*$', re.M)
# workflow -> (job, runs-on, backend its script calls use; None: it runs .ci/run)
JOBS = {
    "ci-cpu.yml": ("gloo", "ubuntu-latest", None),
    "ci-gpu.yml": ("nccl", ["self-hosted", "linux", "gpu"], "nccl"),
    "ci-npu.yml": ("hccl", ["self-hosted", "linux", "npu"], "hccl"),
}
DEVICE_WORKFLOWS = [name for name, (_, _, backend) in JOBS.items() if backend is not None]
# A test of a real 2-rank world from the repository's tests, and the cheapest suite test.
REPO_PICK = "tests/test_world.py::test_all_reduce_sums_across_ranks[2]"
SUITE_PICK = ["-k", "test_saving_over_a_complete_step_is_refused"]
PICKS = {"repo": [REPO_PICK], "suite": SUITE_PICK}


def _workflow(workflow: str) -> dict:
    with open(os.path.join(WORKFLOWS, workflow), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _job(workflow: str) -> dict:
    jobs = _workflow(workflow)["jobs"]
    name = JOBS[workflow][0]
    assert list(jobs) == [name], f"{workflow}: expected the one job {name!r}"
    return jobs[name]


def _runs(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def _calls(job: dict) -> list[list[str]]:
    """The argument lists of every ``bash .ci/run-tests`` line of the job, in order."""
    return [shlex.split(m["args"]) for run in _runs(job) for m in CALL_RE.finditer(run)]


def _run_script(*args: str) -> subprocess.CompletedProcess:
    """``bash .ci/run-tests ARGS`` with this interpreter's environment first on PATH."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


# ---------------------------------------------------------------------------------------
# What the workflows say
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("workflow", list(JOBS))
def test_job_runs_where_and_when_it_should(workflow: str) -> None:
    doc, job = _workflow(workflow), _job(workflow)
    assert job["runs-on"] == JOBS[workflow][1]
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads the bare key `on` as True
    assert {"push", "pull_request"} <= set(triggers)
    assert 0 < job["timeout-minutes"] <= 120
    assert job["steps"][0]["uses"].startswith("actions/checkout@")


def test_cpu_job_runs_ci_run_which_calls_the_script_on_gloo() -> None:
    job = _job("ci-cpu.yml")
    assert _runs(job) == ["bash .ci/run"]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        commands = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    # .ci/run without arguments: fresh venv, CPU torch pinned before the project, the linters
    # (set -e: a finding fails the job before the tests run), then the tests.
    assert "set -euo pipefail" in commands
    venv = commands.index('python3 -m venv "$venv"')
    torch_pin = commands.index("python -m pip install -q torch==2.13.0")
    project = commands.index("python -m pip install -q -e '.[test]'")
    ruff, mypy = commands.index("ruff check ."), commands.index("mypy")
    tests = commands.index("bash .ci/run-tests gloo repo")
    assert venv < torch_pin < project < ruff < mypy < tests
    # then the slower profile `pytest -n 8` skips (the torchrun jobs), and, only where
    # torchtitan and VeOmni installed, the audit of the peers
    assert commands[tests + 1:] == ["bash .ci/run-tests gloo extended", 'if [ "$peers" = yes ]; then',
                                    "bash .ci/run-tests gloo audit", "fi"]


@pytest.mark.parametrize("workflow", DEVICE_WORKFLOWS)
def test_device_job_calls_the_script_with_its_backend(workflow: str) -> None:
    job = _job(workflow)
    backend = JOBS[workflow][2]
    assert _calls(job) == [[backend, "repo"], [backend, "suite"]]
    runs = _runs(job)
    first_call = next(i for i, run in enumerate(runs) if CALL_RE.search(run))
    # The devices are checked before any test runs: a backend that cannot serve a world size
    # skips, so a runner that lost its devices would otherwise pass green.
    check = "torch.cuda.device_count()" if backend == "nccl" else "torch.npu.device_count()"
    assert any(check in run and "assert n >= 1" in run for run in runs[:first_call])
    install = runs[0]
    assert '"$TORCH_SPEC"' in install and "-e '.[test]'" in install
    assert job["env"]["TORCH_SPEC"] == "torch==2.13.0"
    if backend == "hccl":
        assert '"$TORCH_NPU_SPEC"' in install
        for run in runs[1:]:  # every step that imports torch_npu has CANN's environment
            assert CANN_RE.match(run), f"step does not source CANN's set_env.sh first:\n{run}"
        assert job["env"]["CANN_SET_ENV"].endswith("/set_env.sh")


# ---------------------------------------------------------------------------------------
# The lines they run, run here
# ---------------------------------------------------------------------------------------


@pytest.mark.extended
@pytest.mark.parametrize("step", ["repo", "suite"])
def test_device_jobs_lines_run_here_on_gloo(step: str) -> None:
    """The GPU and NPU jobs' line for ``step`` with the backend swapped for gloo, plus a
    one-test selection (``-n 0``: one test needs no eight workers): it runs and passes."""
    lines = {tuple(call[1:]) for wf in DEVICE_WORKFLOWS for call in _calls(_job(wf)) if call[1] == step}
    assert lines == {(step,)}, "the device jobs differ in more than the backend"
    proc = _run_script("gloo", step, "-n", "0", *PICKS[step])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"^1 passed\b", proc.stdout, re.M), out
    if step == "repo":  # the README's command, which .ci/run runs too
        assert "+ python -m pytest -n 8 -q -p no:cacheprovider --backend gloo -n 0 " in proc.stderr, out
    else:
        assert "+ python -m pytest --pyargs faults.suite -n 8 --dist loadgroup -q -p no:cacheprovider " \
               "--backend gloo -n 0 " in proc.stderr, out


def _devices_here(backend: str) -> int:
    """How many devices ``backend`` has here, asked of torch directly."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        return torch.cuda.device_count() if dist.is_nccl_available() else 0
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401  # pragma: no cover - Ascend runners

    return torch.npu.device_count()  # pragma: no cover - Ascend runners


@pytest.mark.extended
@pytest.mark.parametrize("workflow", DEVICE_WORKFLOWS)
def test_device_job_line_as_written_skips_here_without_devices(workflow: str) -> None:
    """The device job's ``repo`` line, backend and all, on a 2-rank world test: with fewer than
    two devices it skips, saying what is missing; with two it runs."""
    backend, step = _calls(_job(workflow))[0]
    proc = _run_script(backend, step, "-n", "0", "-rs", REPO_PICK)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    if _devices_here(backend) >= 2:  # pragma: no cover - device runners
        assert re.search(r"^1 passed\b", proc.stdout, re.M), out
        return
    assert re.search(r"^1 skipped\b", proc.stdout, re.M), out
    reason = ("nccl needs 2 CUDA devices, found" if backend == "nccl"
              else "hccl needs torch_npu, which cannot be imported"
              if importlib.util.find_spec("torch_npu") is None else "hccl needs 2 NPUs, found")
    assert reason in proc.stdout and "run with --backend gloo" in proc.stdout, out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "usage: .ci/run-tests gloo|nccl|hccl|auto repo|extended|suite|audit [PYTEST ARGS...]"),
        (["gloo"], "usage: .ci/run-tests gloo|nccl|hccl|auto repo|extended|suite|audit [PYTEST ARGS...]"),
        (["cuda", "repo"], "unknown backend 'cuda'; usage:"),
        (["gloo", "everything"], "unknown step 'everything'; usage:"),
    ],
)
def test_script_rejects_what_it_does_not_know(args: list[str], message: str) -> None:
    proc = _run_script(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "pytest" not in proc.stdout  # nothing ran


def test_the_runs_processes_cache_bytecode() -> None:
    """The repository's conftest.py lets this run and every process it starts (xdist workers,
    ranks, torchrun jobs, pytest-in-pytest runs) write and read bytecode even where the
    environment sets PYTHONDONTWRITEBYTECODE: otherwise each of about a thousand processes
    compiles the project again and each pytest among them rewrites ~230 modules' asserts."""
    assert not sys.dont_write_bytecode
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    child = subprocess.run([sys.executable, "-c", "import os, sys; "
                            "print(sys.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE' in os.environ)"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.split() == ["False", "False"], child.stdout + child.stderr
