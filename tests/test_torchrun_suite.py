"""The harness inside a job ``torchrun`` launched: :class:`faults.world.TorchrunWorld` and
``python -m faults torchrun-suite``.

Real ``torchrun`` agents (``python -m torch.distributed.run``) on localhost: two agents with a c10d
rendezvous and ``--nnodes=2``, two ranks each, one shared root under ``tmp_path``, as in
``tests/test_torchrun.py``. The suite's entry point judges refckpt, the contract-only
checkpointer and a one-bug mutant in that world; each rank writes its own report (``--json
.../{rank}.json``), and every rank's verdict is asserted. The oracle is the suite's own (runs
recomputed from scratch); what the test knows independently is which checkpointer is broken and
how (``tests/mutants.py``: ``no_checksum`` loads a bit-flipped tensor without an error).

Without a launcher: the torchrun environment parser (consistent and inconsistent environments),
the per-``LOCAL_RANK`` device selection for NCCL/HCCL with the hardware probes replaced, and the
entry point's usage errors and backend skip, in this process (no process group is created).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from faults.backends import HCCL, NCCL, device_for_rank, process_group_backend, select_local_backend
from faults.errors import BackendUnavailable
from faults.torchrun_suite import UsageProblem, prepare_root, run_suite
from faults.torchrun_suite import main as suite_main
from faults.world import TORCHRUN_MARKERS, TorchrunEnv, TorchrunEnvError, TorchrunWorld, World, torchrun_env

from .test_torchrun import _free_port, _tail, _wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180  # seconds for one torchrun job (2 agents x 2 ranks importing torch on 2 cores)
REFCKPT, CONTRACT, MUTANT = "refckpt:DistributedCheckpointer", "tests.contract_ckpt:make", "tests.mutants:no_checksum"


def _job(tmp_path, name: str, suite_args: list[str]) -> tuple[list[int], str, str]:
    """Two torchrun agents (``--nnodes=2``, 2 ranks each, c10d rendezvous on localhost) running
    ``-m faults torchrun-suite``; returns their exit codes, the log and the report folder."""
    port, log, out = _free_port(), str(tmp_path / f"{name}.log"), str(tmp_path / f"{name}-out")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k in TORCHRUN_MARKERS:  # this pytest process may itself run under torchrun
        env.pop(k, None)
    procs = []
    with open(log, "ab") as f:
        for host in ("1", "0"):  # agent A serves the rendezvous store; B is only its client
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=suite-{port}",
                 f"--rdzv-conf=join_timeout=120,last_call_timeout=2,is_host={host}", "--monitor-interval=0.5",
                 "-m", "faults", "torchrun-suite", "--root", str(tmp_path / f"{name}-root"),
                 "--json", os.path.join(out, "{rank}.json"), *suite_args],
                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    return _wait(procs, TIMEOUT), log, out


def _reports(out: str, log: str) -> list[dict]:
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    assert names == ["0.json", "1.json", "2.json", "3.json"], f"reports {names}\n{_tail(log)}"
    reports = []
    for n in names:
        with open(os.path.join(out, n)) as f:
            reports.append(json.load(f))
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert {r["world_size"] for r in reports} == {4} and sorted(r["local_rank"] for r in reports) == [0, 0, 1, 1]
    return reports


def _by_check(report: dict, spec: str) -> dict[str, tuple[str, str]]:
    return {o["check"]: (o["status"], o["detail"]) for o in report["outcomes"] if o["checkpointer"] == spec}


ROUND_TRIPS = ["round_trip[per_rank,sync]", "round_trip[per_rank,async]", "round_trip[rank_invariant,sync]",
               "round_trip[fsdp2,async]"]
NEWEST = [f"newest_complete[{h}]" for h in ("missing_commit", "missing_payload", "truncated_payload",
                                             "missing_extra_state", "garbage", "dangling", "stale")]
INTEGRITY = ["integrity[bitflip_record]", "integrity[truncated_record]", "integrity[bitflip_payload]"]


@pytest.mark.slow
@pytest.mark.torchrun_job  # the slower profile (conftest.py): 2 agents x 2 ranks
def test_two_simulated_nodes_judge_refckpt_the_contract_checkpointer_and_a_mutant_on_every_rank(tmp_path):
    codes, log, out = _job(tmp_path, "suite", ["--checkpointer", REFCKPT, "--checkpointer", CONTRACT,
                                               "--checkpointer", MUTANT])
    # The mutant fails, so every rank exits 1 and each agent reports its ranks' failure.
    assert codes[0] != 0 and codes[1] != 0, _tail(log)
    reports = _reports(out, log)
    for r in reports:  # every rank: the same verdicts, reached by itself and checked against the others'
        assert r["agreed"] is True and r["verdict"] == "fail" and r["failed"] == [MUTANT], r
        assert r["outcomes"] == reports[0]["outcomes"]
    first = reports[0]
    ref, contract, mutant = (_by_check(first, s) for s in (REFCKPT, CONTRACT, MUTANT))
    assert list(ref) == [*ROUND_TRIPS, *NEWEST, *INTEGRITY, "kill_faults"], list(ref)
    assert all(ref[c][0] == "pass" for c in ROUND_TRIPS + NEWEST + INTEGRITY), ref
    # The contract-only checkpointer declares no per-rank extra state: those cases are skipped, saying why.
    for c in ROUND_TRIPS + NEWEST + INTEGRITY:
        want = "skip" if c.startswith("round_trip[per_rank") else "pass"
        assert contract[c][0] == want, (c, contract[c])
    assert "per_rank_extra_state" in contract["round_trip[per_rank,sync]"][1]
    # The mutant is failed by the check of the rule it breaks, and only by it.
    assert mutant["integrity[bitflip_payload]"][0] == "fail", mutant
    assert "loaded step 2 without an error" in mutant["integrity[bitflip_payload]"][1]
    assert [c for c, (s, _) in mutant.items() if s == "fail"] == ["integrity[bitflip_payload]"], mutant
    for table in (ref, contract, mutant):
        assert table["kill_faults"][0] == "skip" and "SIGKILL ranks" in table["kill_faults"][1]
    text = _tail(log, 400)
    assert text.count("verdict: FAIL") == 1, "rank 0 alone prints the report"
    assert "4 ranks (2 nodes x 2), gloo" in text and "every rank reached the same verdicts" in text


@pytest.mark.extended  # 140 s of a 4-rank torchrun world on 2 cores: the extended profile
@pytest.mark.slow
def test_torchrun_world_agrees_on_results_and_errors_and_restarts_under_its_own_store_prefix(tmp_path):
    """``World.from_env()`` in a job of 2 ranks that torchrun restarts once (``--max-restarts=1``;
    rank 1 exits 3 after the first incarnation): in both incarnations every rank gets every rank's
    result, the same ``RankError`` for rank 1's error, and a usable world after it."""
    out, log = tmp_path / "out", str(tmp_path / "world.log")
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k in TORCHRUN_MARKERS:
        env.pop(k, None)
    with open(log, "ab") as f:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                  "--max-restarts=1", "--monitor-interval=0.5",
                                  os.path.join(ROOT, "tests", "_torchrun_world_job.py"), "--out", str(out)],
                                 cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    assert _wait([agent], TIMEOUT) == [0], _tail(log)
    assert sorted(os.listdir(out)) == ["0_0.json", "0_1.json", "1_0.json", "1_1.json"], _tail(log)
    for incarnation in (0, 1):
        for rank in (0, 1):
            with open(out / f"{incarnation}_{rank}.json") as f:
                got = json.load(f)
            assert got["identity"] == [[0, 2, 0, "0"], [1, 2, 1, "0"]]
            assert got["store_prefix"] == f"faults/torchrun/restart_{incarnation}/"
            assert got["raised"] == [1, "ValueError", "rank 1 fails on purpose", [1]]
            assert got["collected"] == [0, "RankError 1 rank 1 fails on purpose"]
            assert got["sum"] == [1.0, 1.0] and got["alive"] is True


def test_the_root_must_be_new_and_checks_known(tmp_path):
    """``prepare_root`` and ``run_suite``'s argument checks, in a spawned world of 2 (the same
    code paths every torchrun rank takes)."""
    busy, fresh = tmp_path / "busy", tmp_path / "fresh"
    (busy / "global_step_1").mkdir(parents=True)
    with World(2, start_method="forkserver", timeout=60) as w:
        with pytest.raises(UsageProblem, match=r"is not empty \(rank 0 sees global_step_1\)"):
            prepare_root(w, str(busy))
        with pytest.raises(UsageProblem, match="unknown check"):
            run_suite(w, [REFCKPT], str(fresh), ["round_trips"])
        with pytest.raises(UsageProblem, match="cannot load it"):
            run_suite(w, ["no_such_module_here:make"], str(fresh))
        assert not fresh.exists()
        prepare_root(w, str(fresh))
        assert sorted(os.listdir(fresh / ".torchrun-suite-ranks")) == ["0", "1"]
    assert os.listdir(busy) == ["global_step_1"]


# -- without a launcher -----------------------------------------------------------------------

GOOD = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_RANK": "1"}


def test_torchrun_env_reads_a_consistent_environment():
    assert torchrun_env({}) is None and torchrun_env({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) is None
    env = torchrun_env(GOOD)
    assert env == TorchrunEnv(3, 4, 1, 2, "10.0.0.1", 29500, 2, 1)
    # a restarted incarnation keys its default group apart from the dead one's (pytorch#135712)
    assert env.store_prefix == "faults/torchrun/restart_2/"
    assert torchrun_env({**GOOD, "TORCHELASTIC_RESTART_COUNT": "0"}).store_prefix != env.store_prefix


@pytest.mark.parametrize("change, says", [
    ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
    ({"RANK": None, "LOCAL_RANK": None}, "RANK, LOCAL_RANK are not set"),
    ({"RANK": "4"}, "RANK=4 is not a rank of WORLD_SIZE=4"),
    ({"RANK": "two"}, "RANK='two' is not an integer"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is not a rank of LOCAL_WORLD_SIZE=2"),
    ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 is not between 1 and WORLD_SIZE=4"),
    ({"RANK": "0"}, "LOCAL_RANK=1 is above RANK=0"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1' is negative"),
])
def test_an_inconsistent_torchrun_environment_is_a_clear_error(change, says):
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(TorchrunEnvError) as e:
        torchrun_env(env)
    assert says in str(e.value) and "looks like a torchrun rank" in str(e.value)
    assert "launch with torchrun" in str(e.value)


def test_device_backends_pick_the_device_of_local_rank_without_hardware():
    # two ranks on this node, two CUDA devices: NCCL, rank with LOCAL_RANK 1 on cuda:1
    choice = select_local_backend("nccl", 1, 2, cuda_count=2)
    assert choice == NCCL and device_for_rank(choice, 1) == __import__("torch").device("cuda", 1)
    assert process_group_backend(choice) == "cpu:gloo,cuda:nccl"
    assert select_local_backend("auto", 0, 2, cuda_count=2) == NCCL
    # the node needs a device per local rank, whatever the job's world size
    with pytest.raises(BackendUnavailable) as e:
        select_local_backend("nccl", 1, 2, cuda_count=1)
    assert "LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2" in e.value.reason and "found 1" in e.value.reason
    assert select_local_backend("hccl", 1, 2, npu_available=True, npu_count=2) == HCCL
    assert process_group_backend(HCCL) == "cpu:gloo,npu:hccl"
    with pytest.raises(BackendUnavailable, match="hccl needs torch_npu"):
        select_local_backend("hccl", 0, 2, npu_available=False)
    assert select_local_backend("auto", 1, 2, cuda_count=0, npu_available=False).backend == "gloo"
    with pytest.raises(ValueError, match="LOCAL_RANK=2 is not a rank of LOCAL_WORLD_SIZE=2"):
        select_local_backend("gloo", 2, 2)


def test_world_from_env_on_this_machine():
    """``World.from_env`` with this machine's real probes: gloo works; nccl and hccl are a
    ``BackendUnavailable`` naming the local rank, unless the hardware is there."""
    import torch

    environ = {**GOOD, "MASTER_ADDR": "127.0.0.1"}
    w = World.from_env("gloo", environ=environ)
    assert isinstance(w, TorchrunWorld) and (w.rank, w.world_size, w.local_rank) == (3, 4, 1)
    assert str(w.device) == "cpu" and not w.alive and "new" in repr(w)
    if torch.cuda.device_count() < 2:
        with pytest.raises(BackendUnavailable, match="LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2"):
            World.from_env("nccl", environ=environ)
    with pytest.raises(TorchrunEnvError, match="not a torchrun rank"):
        World.from_env("gloo", environ={})
    with pytest.raises(NotImplementedError, match="no parent to kill ranks"):
        w.run(print, on_event=lambda rank, payload: None)


def test_entry_point_usage_errors_and_backend_skip(monkeypatch, tmp_path, capsys):
    for k in TORCHRUN_MARKERS:
        monkeypatch.delenv(k, raising=False)
    args = ["--checkpointer", REFCKPT, "--root", str(tmp_path / "root")]
    assert suite_main(args) == 2
    assert "not a torchrun rank" in capsys.readouterr().err
    for k, v in {**GOOD, "LOCAL_RANK": "5"}.items():
        monkeypatch.setenv(k, v)
    assert suite_main(args) == 2
    err = capsys.readouterr().err
    assert "LOCAL_RANK=5 is not a rank of LOCAL_WORLD_SIZE=2" in err and err.startswith("faults torchrun-suite: error:")
    import torch

    if torch.cuda.device_count() < 2:  # a consistent environment, a backend this node cannot serve: a skip
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert suite_main([*args, "--backend", "nccl"]) == 0
        assert "SKIP (rank 3): torchrun rank with LOCAL_RANK=1" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "root")


PLUGIN_TESTS = '''
import pytest
import torch
import torch.distributed as dist

from faults.world import TorchrunWorld


def info(offset):
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_world_is_the_jobs(world, world_factory):
    assert isinstance(world, TorchrunWorld) and world_factory.get(1) is world
    assert world.run(info, 0.5) == [(0, 1, 0.5)]


@pytest.mark.world_size(2)
def test_another_size(world):
    raise AssertionError("not skipped")


def test_fresh(fresh_world):
    fresh_world(1)
    raise AssertionError("not skipped")
'''


@pytest.mark.extended
def test_plugin_fixtures_under_an_env_world(pytester, monkeypatch):
    """The plugin in a pytest process whose environment is a torchrun rank's (a real env://
    world of 1 rank, hosting its own store): ``world`` is the job's world, other sizes and
    ``fresh_world`` skip with the reason; an inconsistent environment and collecting
    ``faults.suite`` are usage errors."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_env_world=PLUGIN_TESTS)
    quiet = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:xdist")
    result = pytester.runpytest_subprocess(*quiet, "-rs", "test_env_world.py", timeout=120)
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*under torchrun the world is the job's (WORLD_SIZE=1); a world of 2 ranks cannot*",
                                 "*fresh_world: under torchrun the world is the job's*"])
    result = pytester.runpytest_subprocess(*quiet, "--pyargs", "faults.suite.test_multirank", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*faults.suite under torchrun (this is rank 0 of 1)*faults torchrun-suite*"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    result = pytester.runpytest_subprocess(*quiet, "test_env_world.py", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*LOCAL_RANK=1 is not a rank of LOCAL_WORLD_SIZE=1*"])
