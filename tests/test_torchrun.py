"""refckpt in jobs that ``torchrun`` (torch elastic) launches and restarts, as users run them.

Every test starts real ``torchrun`` agents (``python -m torch.distributed.run``) on localhost with
``tests/_torchrun_job.py``: FSDP2 on gloo, async saves, ``load_latest`` on start. Two agents with
a c10d rendezvous and ``--nnodes`` stand for two nodes. What the job wrote to its ``--out``
folder (digests of the full state at each save, acknowledged steps, where each incarnation
resumed) is the oracle; nothing is read back from the checkpointer to judge it.

* two simulated nodes (2 agents x 1 rank) save into one shared root, and a second job (2 agents x
  2 ranks) resumes bitwise from it, resharded; before it, the first job saves into a root each
  node is given its own of (a node-local disk): the save is refused on every rank and nothing is
  published in either root, and the job goes on;
* a rank SIGKILLed right after dispatching an async save; torchrun restarts the group
  (``--max-restarts=1``) with the last rank arriving 3 s late on purpose, at the default group's
  rendezvous and at the checkpointer's first collective: the new incarnation resumes bitwise from
  the newest complete step and loses no acknowledged save;
* the agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/design.md tells users: on
  torchrun's default shared store, a restarted incarnation whose last rank arrives late fails (or
  hangs) in plain ``init_process_group`` ("Gloo connectFullMesh failed ... Connection refused": it
  read the dead incarnation's peer address; pytorch#135712, reproduced by hand with torch 2.13, too
  unpredictable in how it fails for a test); refckpt warns in such a job;
* a node leaves (its agent SIGKILLed with its rank, ``--nnodes=1:2``): the job restarts at half
  the world size, model and optimizer reshard, and resume is bitwise; per-rank extra state (the
  same job also saves into a second root with it) then fails with the documented clear error
  instead of dropping the gone rank's state.

Each job is two to six fresh interpreters that import torch (about 3 CPU s each on this
machine's 2 cores), so checks share jobs where one job can carry them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_torchrun_job.py")
TIMEOUT = 240  # seconds for a whole torchrun job (2 cores, 2-4 ranks importing torch, restarts)

# Slow: started first. Not one xdist group: each job has its own ports and roots, and one group
# made these jobs (about 200 s under load, a third of it rendezvous waits) the run's longest chain
# once groups took effect (faults.plugin). The jobs are marked torchrun_job: the extended profile
# (`pytest -n 4 --extended -m "extended or torchrun_job"`, run by .ci/run after `pytest -n 8`), since
# their fresh interpreters took about a sixth of the CPU of `pytest -n 8` on 2 cores.
pytestmark = [pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(args: list[str], job_args: list[str], log: str) -> subprocess.Popen:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as docs/design.md tells users: on torchrun's shared
    # store a restarted incarnation's default group reads the dead one's peer addresses when a rank
    # arrives late (pytorch#135712).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    f = open(log, "ab")  # noqa: SIM115 - closed with the process in _wait
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, JOB, *job_args],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def _two_agents(tmp_path, job_args_a: list[str], job_args_b: list[str] | None = None, *, nnodes: str = "2",
                nproc: int = 1, extra: tuple[str, ...] = (), last_call: int = 2) -> tuple[list[int], str]:
    """Two torchrun agents with a c10d rendezvous on localhost; agent A hosts the rendezvous store. ``last_call``: how
    long a rendezvous that has its minimum of nodes waits for more (with ``--nnodes=1:2``, long
    enough for agent B to join the first round)."""
    port = _free_port()
    common = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=refckpt-{port}", "--monitor-interval=0.5", *extra]
    conf = f"--rdzv-conf=join_timeout=120,last_call_timeout={last_call},is_host="
    log = str(tmp_path / "torchrun.log")
    # is_host: A serves the rendezvous store, B is only ever its client (a TCPStore client retries
    # until the server is up), so both start at once and B leaving never takes the store with it.
    a = _agent([*common, conf + "1"], job_args_a, log)
    b = _agent([*common, conf + "0"], job_args_b if job_args_b is not None else job_args_a, log)
    return _wait([a, b]), log


def _tail(log: str, n: int = 60) -> str:
    with open(log, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def _read(out, name: str):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def _acked(out) -> list[int]:
    path = os.path.join(out, "acked.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def _steps(root) -> list[int]:
    return sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_")) \
        if os.path.isdir(root) else []


def _assert_resumed_bitwise(out, incarnation: int, acked_before: list[int]) -> dict:
    resumed = _read(out, f"resume_{incarnation}.json")
    assert resumed["step"] >= max(acked_before, default=0), (
        f"incarnation {incarnation} resumed step {resumed['step']}, but step {max(acked_before)} was acknowledged")
    assert resumed["step"] > 0, "nothing was resumed"
    saved = _read(out, f"digest_{resumed['step']}_0.json")["digest"]
    assert resumed["digest"] == saved, (
        f"the state resumed at step {resumed['step']} is not bitwise the state saved there")
    return resumed


@pytest.mark.torchrun_job
def test_two_simulated_nodes_share_a_root_and_a_second_job_resumes_bitwise(tmp_path):
    """Two nodes of one rank each save into one root; a second job of two nodes of two ranks each
    resumes it bitwise, resharded from 2 ranks to 4 (the digests are of the full state). First,
    the first job saves into a root each node has its own of: refused on every rank, nothing
    published, and the job goes on."""
    root, out1, out2 = tmp_path / "ckpt", tmp_path / "out1", tmp_path / "out2"
    out1.mkdir(), out2.mkdir()
    args = ["--root", str(root), "--out", str(out1), "--steps", "4", "--every", "2"]
    local_a, local_b = tmp_path / "node_a", tmp_path / "node_b"
    codes, log = _two_agents(tmp_path, [*args, "--node-local-root", str(local_a)],
                             [*args, "--node-local-root", str(local_b)], nproc=1)
    assert codes == [0, 0], _tail(log)
    for rank in (0, 1):
        outcome = (out1 / f"node_local_{rank}.txt").read_text()
        assert outcome.startswith("SaveFailedError: ") and "the checkpoint root is not one shared directory" in outcome, (
            rank, outcome)
    for local in (local_a, local_b):
        assert _steps(local) == [] and not [n for n in os.listdir(local) if n.endswith(".partial")] \
            if os.path.isdir(local) else True
    assert _read(out1, "done.json") == {"step": 4, "world_size": 2}
    assert _acked(out1) == [2, 4] and _steps(root) == [2, 4]
    shards = sorted(n for n in os.listdir(root / "global_step_4") if n.endswith(".safetensors"))
    assert shards == [f"__{r}_0.safetensors" for r in range(2)], shards
    codes, log = _two_agents(tmp_path, ["--root", str(root), "--out", str(out2), "--steps", "6", "--every", "2"],
                             nproc=2)
    assert codes == [0, 0], _tail(log)
    resumed = _read(out2, "resume_0.json")
    assert resumed["step"] == 4 and resumed["world_size"] == 4
    assert resumed["digest"] == _read(out1, "digest_4_0.json")["digest"]
    assert _read(out2, "done.json") == {"step": 6, "world_size": 4}


@pytest.mark.torchrun_job
def test_elastic_restart_after_a_kill_mid_save_resumes_bitwise_with_skewed_arrival(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    log = str(tmp_path / "torchrun.log")
    agent = _agent(["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5"],
                   ["--root", str(root), "--out", str(out), "--steps", "8", "--every", "2",
                    "--kill-rank", "1", "--kill-at-step", "4", "--skew", "3"], log)
    assert _wait([agent]) == [0], _tail(log)
    # Incarnation 0 acknowledged step 2 (saving step 4 waited for it) and died with step 4 in flight.
    acked = _acked(out)
    assert acked[0] == 2, acked
    resumed = _assert_resumed_bitwise(out, 1, [2])
    assert resumed["world_size"] == 2
    assert _read(out, "done.json") == {"step": 8, "world_size": 2}
    assert 8 in _steps(root)


@pytest.mark.torchrun_job
def test_a_node_leaves_the_job_resumes_resharded_and_per_rank_extra_state_is_a_clear_error(tmp_path):
    """One job saves every step twice: into a root with embedded extra state, and into one with
    per-rank extra state (``--per-rank-root``). A node leaves; the restarted job at half the
    world resumes the embedded root bitwise, resharded, while ``load_latest`` of the per-rank root
    raises the documented clear error instead of dropping the gone rank's state."""
    root, per_rank, out = tmp_path / "ckpt", tmp_path / "per_rank", tmp_path / "out"
    out.mkdir()
    args = ["--root", str(root), "--out", str(out), "--steps", "6", "--every", "2", "--per-rank-root", str(per_rank)]
    codes, log = _two_agents(tmp_path, args, [*args, "--kill-rank", "1", "--kill-at-step", "4", "--kill-agent"],
                             nnodes="1:2", extra=("--max-restarts=1",), last_call=20)
    assert codes[0] == 0, _tail(log)
    assert codes[1] == -signal.SIGKILL, codes  # agent B was killed with its rank: its node left
    assert _read(out, "resume_0.json")["world_size"] == 2
    resumed = _assert_resumed_bitwise(out, 1, [2])
    assert resumed["world_size"] == 1, "the restarted job should run on the one node left"
    assert _read(out, "done.json") == {"step": 6, "world_size": 1}
    assert (out / "per_rank_error_0.txt").read_text() == "loaded None"  # a new root: nothing to resume
    error = (out / "per_rank_error_1.txt").read_text()
    assert not error.startswith("loaded"), "the job resumed a per-rank checkpoint of 2 ranks on 1 rank without an error"
    assert "per-rank extra state was saved by 2 ranks; this world has 1" in error, error


def test_a_job_that_torchrun_may_restart_on_its_shared_store_is_warned(caplog):
    """The hazard the agents here are launched to avoid (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is
    named to users whose job runs on torchrun's shared store with restarts; nowhere else."""
    from refckpt import checkpointer

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert checkpointer.warn_shared_agent_store(shared)
    assert not checkpointer.warn_shared_agent_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not checkpointer.warn_shared_agent_store({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert not checkpointer.warn_shared_agent_store({})


def test_the_torchrun_jobs_are_the_slower_profile_and_ci_runs_it(request):
    """Every test here and in test_torchrun_suite.py that launches torchrun agents is marked
    ``torchrun_job`` -- but one: the default run keeps one real torchrun job (one agent, two
    ranks, a restart: test_torchrun_world_agrees...). `pytest -n 8` skips the marked ones, saying
    where they run, and .ci/run runs them."""
    import inspect

    from tests import test_torchrun_suite

    kept = "test_torchrun_world_agrees_on_results_and_errors_and_restarts_under_its_own_store_prefix"
    jobs = set()
    for module in (sys.modules[__name__], test_torchrun_suite):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("test_") and fn.__module__ == module.__name__ and name != request.function.__name__:
                source = inspect.getsource(fn)
                marked = any(m.name == "torchrun_job" for m in getattr(fn, "pytestmark", []))
                launches = any(call in source for call in ("_agent(", "_two_agents(", "_job(tmp_path", "torch.distributed.run"))
                assert marked == (launches and name != kept), (name, marked, launches)
                jobs |= {name} if marked else set()
    assert len(jobs) == 4, jobs
    import conftest

    for item in request.session.items:
        if item.get_closest_marker("torchrun_job") is None:
            continue
        skips = [m.kwargs.get("reason") for m in item.iter_markers("skip")]
        if request.config.getoption("--extended"):
            assert not skips, item.nodeid
        else:
            assert skips == [conftest.TORCHRUN_JOBS_SKIP], (item.nodeid, skips)
    with open(os.path.join(ROOT, ".ci", "run-tests"), encoding="utf-8") as f:
        assert 'python -m pytest -n 4 -q -p no:cacheprovider --extended -m "extended or torchrun_job"' in f.read()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "bash .ci/run-tests gloo extended\n" in f.read()
