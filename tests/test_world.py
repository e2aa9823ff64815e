"""Tests of ``faults.world`` with real gloo process groups (the plugin: ``test_plugin.py``).

Worlds that no fault kills come from the session ``world_factory`` (spawning torch ranks costs
1-2 s each); tests whose fault kills or poisons a world use a fresh one. No test sleeps: each
synchronises on results, events or process exit.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from faults.world import (
    BackendChoice,
    BackendUnavailable,
    RankDied,
    RankError,
    World,
    WorldCloseError,
    WorldTimeout,
    device_for_rank,
    emit,
    run_world,
    select_backend,
)
from tests import _world_fns as fns

GLOO = BackendChoice("gloo", "cpu")
NCCL = BackendChoice("nccl", "cuda")
HCCL = BackendChoice("hccl", "npu")


def _gone(pid: int) -> bool:
    """True when no process has this pid (ranks are reaped by the World)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------------------------------
# select_backend / device_for_rank (no processes)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuda", [0, 1, 8])
def test_gloo_always_available(cuda: int) -> None:
    assert select_backend("gloo", 4, cuda_count=cuda, npu_available=False) == GLOO


def test_nccl_needs_world_size_cuda_devices() -> None:
    with pytest.raises(BackendUnavailable) as e0:
        select_backend("nccl", 4, cuda_count=0)
    assert str(e0.value) == "nccl needs 4 CUDA devices, found 0; run with --backend gloo"
    assert e0.value.reason == str(e0.value)
    assert isinstance(e0.value, RuntimeError)
    with pytest.raises(BackendUnavailable, match="nccl needs 4 CUDA devices, found 1"):
        select_backend("nccl", 4, cuda_count=1)
    assert select_backend("nccl", 4, cuda_count=4) == NCCL
    assert select_backend("nccl", 1, cuda_count=1) == NCCL


def test_hccl_needs_torch_npu_and_world_size_npus() -> None:
    with pytest.raises(BackendUnavailable, match=r"hccl needs torch_npu.*run with --backend gloo"):
        select_backend("hccl", 2, npu_available=False, npu_count=8)
    with pytest.raises(BackendUnavailable, match="hccl needs 4 NPUs, found 2; run with --backend"):
        select_backend("hccl", 4, npu_available=True, npu_count=2)
    assert select_backend("hccl", 4, npu_available=True, npu_count=4) == HCCL


def test_hccl_real_probe_without_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except Exception:
        pass
    else:  # pragma: no cover - Ascend runners
        pytest.skip("torch_npu is importable here")
    with pytest.raises(BackendUnavailable, match="hccl needs torch_npu, which cannot be imported"):
        select_backend("hccl", 1)


def test_nccl_and_auto_real_probes() -> None:
    """Without injected counts: what the GPU job's ``--backend nccl`` and a plain ``auto`` get
    on this machine, compared with what torch itself reports."""
    import importlib.util

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.device_count() if dist.is_nccl_available() else 0
    if cuda >= 1:  # pragma: no cover - GPU runners
        assert select_backend("nccl", cuda) == NCCL
    with pytest.raises(BackendUnavailable, match=rf"nccl needs {cuda + 1} CUDA devices, found {cuda}; run with"):
        select_backend("nccl", cuda + 1)
    if importlib.util.find_spec("torch_npu") is not None:  # pragma: no cover - Ascend runners
        pytest.skip("torch_npu is importable here: auto may pick hccl")
    assert select_backend("auto", 1) == (NCCL if cuda >= 1 else GLOO)


@pytest.mark.parametrize(
    ("cuda", "npu_ok", "npus", "world_size", "expected"),
    [
        (4, False, 0, 4, NCCL),
        (8, True, 8, 4, NCCL),  # nccl preferred over hccl
        (1, True, 4, 4, HCCL),
        (0, True, 2, 2, HCCL),
        (0, False, 8, 2, GLOO),  # NPUs counted only when torch_npu imports
        (1, True, 1, 2, GLOO),
        (0, False, 0, 1, GLOO),
    ],
)
def test_auto_fallbacks(
    cuda: int, npu_ok: bool, npus: int, world_size: int, expected: BackendChoice
) -> None:
    got = select_backend(
        "auto", world_size, cuda_count=cuda, npu_available=npu_ok, npu_count=npus
    )
    assert got == expected


def test_select_backend_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown backend 'mpi'; choose one of gloo, nccl, hccl"):
        select_backend("mpi", 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        select_backend("gloo", 0)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        World(2, "auto")


def test_device_for_rank() -> None:
    assert str(device_for_rank(GLOO, 3)) == "cpu"
    assert str(device_for_rank(NCCL, 3)) == "cuda:3"
    try:
        import torch_npu  # noqa: F401
    except Exception:
        with pytest.raises(BackendUnavailable, match="'npu:1' needs torch_npu"):
            device_for_rank(HCCL, 1)
    else:  # pragma: no cover - Ascend runners
        assert str(device_for_rank(HCCL, 1)) == "npu:1"


def test_emit_outside_a_world_raises() -> None:
    with pytest.raises(RuntimeError, match="outside a World rank"):
        emit("x")


# ---------------------------------------------------------------------------------------
# Reused worlds (no fault)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_results_come_back_in_rank_order(world_factory, n: int) -> None:
    world = world_factory.get(n)
    results = world.run(fns.whoami)
    assert [r[0] for r in results] == list(range(n))
    assert {r[1] for r in results} == {n}
    assert [r[2] for r in results] == world.pids
    assert len(set(world.pids)) == n and os.getpid() not in world.pids


@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_reduce_sums_across_ranks(world_factory, n: int) -> None:
    world = world_factory.get(n)
    expected = [sum(r + 0.25 for r in range(n)), float(n)]
    assert world.run(fns.all_reduce_rank_plus, 0.25) == [expected] * n


def test_args_and_kwargs_reach_every_rank(world_factory) -> None:
    world = world_factory.get(2)
    out = world.run(fns.echo, 1, "two", key=[3])
    assert out == [(0, (1, "two"), {"key": [3]}), (1, (1, "two"), {"key": [3]})]


def test_world_is_reused_across_runs(world_factory) -> None:
    world = world_factory.get(2)
    pids = world.pids
    for i in range(5):
        assert world.run(fns.all_reduce_rank_plus, float(i)) == [[2 * i + 1.0, 2.0]] * 2
    assert world.pids == pids and world.alive
    assert world_factory.get(2) is world


def test_ranks_run_single_threaded(world_factory) -> None:
    assert world_factory.get(2).run(fns.num_threads) == [(1, "1")] * 2


def test_unpicklable_function_fails_in_caller_and_keeps_world(world_factory) -> None:
    world = world_factory.get(1)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        world.run(lambda: 1)
    assert world.alive
    assert world.run(fns.whoami)[0][0] == 0


def test_events_are_delivered_in_order_and_acked(world_factory) -> None:
    world = world_factory.get(2)
    seen: list[tuple[int, object]] = []
    assert world.run(fns.emit_count, 3, on_event=lambda r, p: seen.append((r, p))) == [3, 3]
    for rank in (0, 1):
        assert [p for r, p in seen if r == rank] == [0, 1, 2]
    assert world.alive


# ---------------------------------------------------------------------------------------
# Faults: each kills (or poisons) its world, so each uses a fresh one
# ---------------------------------------------------------------------------------------


def test_rank_exception_comes_back_with_rank_and_traceback(fresh_world) -> None:
    world = fresh_world.make(2)
    pids = world.pids
    with pytest.raises(RankError) as info:
        world.run(fns.raise_on, 1, "boom from rank one")
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.exc_message == "boom from rank one"
    assert "_raising_helper" in err.remote_traceback
    assert "ValueError: boom from rank one" in err.remote_traceback
    msg = str(err)
    assert msg.startswith("rank 1 raised ValueError: boom from rank one")
    assert "_raising_helper" in msg and "tests._world_fns.raise_on" in msg
    assert not world.alive and all(_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="not alive"):
        world.run(fns.whoami)


def test_rank_error_while_peers_block_in_collective() -> None:
    # The peers sit in a barrier the failed rank never joins; the world must not wait for
    # the process-group timeout (60 s here) but kill everything after the error grace.
    with World(4, timeout=60.0, error_grace=0.5, start_method="forkserver") as world:
        pids = world.pids
        start = time.monotonic()
        with pytest.raises(RankError) as info:
            world.run(fns.raise_on_then_barrier, 2, "rank two fails")
        assert time.monotonic() - start < 30
    assert info.value.rank == 2
    assert info.value.unanswered == [0, 1, 3]
    assert "ranks [0, 1, 3] had not answered" in str(info.value)
    assert all(_gone(p) for p in pids)


def test_unpicklable_result_is_a_rank_error(fresh_world) -> None:
    world = fresh_world.make(1)
    with pytest.raises(RankError, match="rank 0 raised TypeError: cannot pickle"):
        world.run(fns.unpicklable_result)


def test_sigkilled_rank_is_reported_with_its_signal() -> None:
    start = time.monotonic()
    with pytest.raises(RankDied) as info:
        run_world(fns.sigkill_self_on, 2, 1, timeout=60.0)
    assert time.monotonic() - start < 30  # detected promptly, not at the timeout
    err = info.value
    assert (err.rank, err.exitcode, err.signal) == (1, -9, "SIGKILL")
    assert "rank 1 (exit code -9) was killed by SIGKILL" in str(err)


def test_rank_exit_code_is_reported(fresh_world) -> None:
    world = fresh_world.make(2)
    with pytest.raises(RankDied) as info:
        world.run(fns.exit_on, 0, 7)
    assert (info.value.rank, info.value.exitcode, info.value.signal) == (0, 7, None)
    assert "exited with code 7" in str(info.value)


def test_hanging_rank_times_out_and_leaves_no_process(fresh_world) -> None:
    world = fresh_world.make(2)
    pids = world.pids
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        world.run(fns.hang_on, 1, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 20
    assert isinstance(info.value, TimeoutError)
    assert info.value.unanswered == [0, 1]
    assert "ranks [0, 1] did not answer within 3 s running tests._world_fns.hang_on" in str(
        info.value
    )
    # The hang is explained: every rank's Python stack at the timeout, naming where it waits.
    # Rank 1 hangs in hang_on's Event().wait(); rank 0 waits in the barrier of its collective.
    assert set(info.value.stacks) == {0, 1}
    assert "hang_on" in info.value.stacks[1] and "threading.py" in info.value.stacks[1]
    assert "_world_fns.py" in info.value.stacks[0]
    assert "--- rank 1: Python stack of every thread at the timeout ---" in str(info.value)
    assert world.exitcodes == [-signal.SIGKILL] * 2
    assert all(_gone(p) for p in pids)
    assert not world.alive


def test_emit_lets_the_parent_kill_a_rank_at_that_moment(fresh_world) -> None:
    world = fresh_world.make(2)
    events: list[tuple[int, object]] = []

    def kill_it(rank: int, payload: object) -> None:
        events.append((rank, payload))
        os.kill(world.pids[rank], signal.SIGKILL)

    with pytest.raises(RankDied) as info:
        world.run(fns.emit_then_barrier, 1, on_event=kill_it)
    assert events == [(1, {"rank": 1, "pid": world.pids[1], "moment": "before-barrier"})]
    assert (info.value.rank, info.value.signal) == (1, "SIGKILL")


def test_factory_replaces_a_dead_world(world_factory) -> None:
    world = world_factory.get(1)
    with pytest.raises(RankDied):
        world.run(fns.sigkill_self_on, 0)
    assert not world.alive
    again = world_factory.get(1)
    assert again is not world and again.alive
    assert again.run(fns.whoami)[0][:2] == (0, 1)


# ---------------------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------------------


def test_close_exits_every_rank_with_code_zero() -> None:
    world = World(2, timeout=60.0).start()  # spawn: the default start method is exercised here
    pids = world.pids
    assert world.run(fns.all_reduce_rank_plus, 0.0) == [[1.0, 2.0]] * 2
    world.close()
    assert world.exitcodes == [0, 0]
    assert all(_gone(p) for p in pids)
    assert not world.alive
    world.close()  # idempotent


def test_run_world_returns_results_and_closes_cleanly() -> None:
    assert run_world(fns.echo, 2, "x", timeout=60.0, start_method="forkserver") == [(0, ("x",), {}), (1, ("x",), {})]


@pytest.mark.parametrize(
    ("how", "expected"), [("5", "rank 1: exit 5"), ("SIGABRT", "rank 1: exit -6 (SIGABRT)")]
)
def test_bad_exit_at_close_is_an_error(how: str, expected: str) -> None:
    world = World(2, timeout=60.0, start_method="forkserver").start()
    world.run(fns.break_exit_on, 1, how)
    with pytest.raises(WorldCloseError) as info:
        world.close()
    assert f"did not close cleanly: rank 0: exit 0, {expected}" in str(info.value)
    assert world.exitcodes[0] == 0 and not world.alive


def test_rank_killed_between_runs_fails_close() -> None:
    world = World(2, timeout=60.0, start_method="forkserver").start()
    world.run(fns.whoami)
    os.kill(world.pids[1], signal.SIGKILL)
    with pytest.raises(WorldCloseError, match="rank 1 .*killed by SIGKILL"):
        world.close()


def test_forkserver_world_starts_and_closes_cleanly():
    from faults.world import run_world

    out = run_world(fns.whoami, 2, start_method="forkserver", timeout=60)
    assert [r[:2] for r in out] == [(0, 2), (1, 2)]


def test_collect_failures_reports_survivors_of_a_dead_rank():
    """Survivors of a dead peer must fail in bounded time; collect mode shows what each did."""
    from faults.world import RankDied, run_world

    out = run_world(fns.last_rank_dies_others_barrier, 3, start_method="forkserver", timeout=60,
                    collect_failures=True)
    assert out[0] == out[1] == "raised RuntimeError"
    assert isinstance(out[2], RankDied) and out[2].signal == "SIGKILL"
