"""A training run as a hypothesis state machine, in a real multi-process world.

Rules: train k steps; save (sync/async); wait for an async save; save a complete step again
(refused, or with ``overwrite=True``); crash -- SIGKILL every rank the moment one rank reaches
the nth file-system operation of a save (before or after it), as a launcher kills a job
whose rank died; damage the disk (missing commit record, missing or truncated payload, missing
extra state, a commit record bit-flipped, truncated, rewritten or forged, a FIFO in place of a
payload file: everything ``find_latest_checkpoint`` must see without reading payload bytes) or the
pointer (absent, empty, torn, garbage, NUL, dangling, stale); resume in fresh objects, in a
fresh world after a crash.

The model is what the suite itself did: which saves were acknowledged (``save`` returned, or
``maybe_wait_for_async_save`` did), which were in flight at a crash (complete iff the commit
record made it to disk: the on-disk contract), which steps it damaged. After every resume:
every rank landed on the newest complete step, the same one; the restored state equals an
uninterrupted run to that step (bitwise: parameters, every moment, param groups, per-rank
extra state); no acknowledged save was lost. After every crash: the pointer is untouched or
names a complete step. After every train: the state equals an uninterrupted run (so training
resumed from a checkpoint is bitwise the run that never stopped).

Drawn per example: world size (``--world-sizes``), model, optimizers, dtype, sharding
(replicated or FSDP2), extra-state layout, retention (``keep_last``). Only what the
checkpointer declares (:mod:`faults.contract`) is drawn: per-rank or embedded extra state,
``keep_last``, ``overwrite``, resuming into an unprimed optimizer; steps start at 1. Failures print the
rule sequence and ``@reproduce_failure``; ``--hypothesis-seed`` replays a run.
"""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from faults import training as T
from faults.contract import Capability as C
from faults.contract import Limitation as L
from faults.inject import FaultNotApplicable, kill_on_event
from faults.strategies import crash_points, damage_pointer, damage_step, disk_damage, pointer_damage, run_configs

from ._common import (
    Completeness,
    Stats,
    accepts,
    advise,
    async_draws,
    budget,
    has,
    lacks,
    read_pointer,
    refused_in_rank,
    shardings,
    step_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
RUN_TIMEOUT = 120.0
#: this many armed crashes and not one fired is reported as thin coverage (an advisory)
THIN_ARMED = 4


@pytest.mark.slow
def test_training_run_state_machine(checkpointer_spec, checkpointer_factory, world_factory, suite_world_size,
                                    tmp_path_factory, request):
    ws = suite_world_size
    stats = Stats(request)
    caps = {"embedded": has(checkpointer_factory, C.EMBEDDED_EXTRA_STATE),
            "per_rank": has(checkpointer_factory, C.PER_RANK_EXTRA_STATE),
            "keep_last": [k for k in (1, 2) if accepts(checkpointer_factory, keep_last=k)],
            "overwrite": has(checkpointer_factory, C.OVERWRITE),
            "priming": has(checkpointer_factory, C.PRIMING),
            "record": not lacks(checkpointer_factory, L.NO_COMMIT_RECORD),
            "pointer": not lacks(checkpointer_factory, L.NO_POINTER)}
    saves, layouts = async_draws(checkpointer_factory), shardings(checkpointer_factory)
    committed = Completeness(checkpointer_factory)

    class TrainingRun(RuleBasedStateMachine):
        @initialize(data=st.data())
        def setup(self, data: st.DataObject) -> None:
            stats.add("examples")
            per_rank = st.sampled_from([True, False]) if caps["per_rank"] else st.just(False)
            self.cfg = data.draw(run_configs(ws, extra_per_rank=per_rank, sharding=layouts), label="config")
            self.keep_last = data.draw(st.sampled_from([None, *caps["keep_last"]]), label="keep_last")
            self.ck_kwargs = {} if self.keep_last is None else {"keep_last": self.keep_last}
            if not self.cfg.extra_per_rank and caps["embedded"]:
                self.ck_kwargs["extra_state_per_rank"] = False
            self.id = uuid.uuid4().hex
            self.root = str(tmp_path_factory.mktemp("machine"))
            self.world = world_factory.get(ws)
            self.run(T.r_start, self.cfg, checkpointer_spec, self.ck_kwargs)
            self.live, self.step = True, 0
            self.acked: set[int] = set()
            self.pending: set[int] = set()
            self.inflight: set[int] = set()
            self.damaged: set[int] = set()
            self.seen_committed: set[int] = set()  # in-flight steps a crash left complete (retention counts them)

        def run(self, fn, *args):
            return self.world.run(fn, self.id, *args, timeout=RUN_TIMEOUT)

        def teardown(self):
            if getattr(self, "live", False) and self.world.alive:
                self.run(T.r_drop)

        # -- training and saving -----------------------------------------------------------

        @precondition(lambda self: self.live)
        @rule(k=st.integers(1, 3))
        def train(self, k):
            for rank, (step, got, want) in enumerate(self.run(T.r_train, k)):
                assert got == want, f"rank {rank}: step {step} differs from an uninterrupted run"
            self.step = step

        def _fresh_step(self) -> bool:
            # never step 0: some real checkpointers take it for "no step"
            return (self.live and self.step >= 1 and self.step not in self.pending
                    and not os.path.lexists(step_path(self.root, self.step)))

        @precondition(lambda self: self._fresh_step())
        @rule(save_async=saves)
        def save(self, save_async):
            errors = self.run(T.r_save, self.root, save_async)
            assert errors == [None] * ws, f"save of step {self.step} failed: {errors}"
            (self.pending if save_async else self.acked).add(self.step)
            stats.add("saves")
            if not save_async:  # a save waits for the previous async one first
                self.acked |= self.pending
                self.pending.clear()

        @precondition(lambda self: self.live and self.pending)
        @rule()
        def wait(self):
            errors = self.run(T.r_wait)
            assert errors == [None] * ws, f"async save failed: {errors}"
            self.acked |= self.pending
            self.pending.clear()

        @precondition(lambda self: caps["overwrite"] and self.live and self.step in self.acked
                      and self.step not in self.damaged and committed(self.root, self.step) and not self.pending)
        @rule(overwrite=st.booleans())
        def save_again(self, overwrite):
            errors = self.run(T.r_save, self.root, False, overwrite)
            if overwrite:
                assert errors == [None] * ws, f"overwrite=True save of step {self.step} failed: {errors}"
            else:
                assert all(e is not None for e in errors), f"saving over complete step {self.step} was not refused: {errors}"
                refused_in_rank(errors, "a refused save over a complete step")

        # -- faults ------------------------------------------------------------------------

        @precondition(lambda self: self._fresh_step() or (
            self.live and caps["overwrite"] and self.step in self.acked and self.step not in self.damaged
            and committed(self.root, self.step) and not self.pending))
        @rule(point=crash_points(), who=st.integers(-1, 3), save_async=saves)
        def crash(self, point, who, save_async):
            nth, when = point
            ranks = tuple(range(ws)) if who < 0 else (who % ws,)
            overwrite = os.path.lexists(step_path(self.root, self.step))
            before = read_pointer(self.root)
            world = self.world
            self.acked |= self.pending  # r_crash_save waits for them before it arms the crash
            self.pending.clear()
            from faults.world import RankDied

            try:
                errors = world.run(T.r_crash_save, self.id, self.root, save_async, overwrite, nth, when, ranks,
                                   timeout=RUN_TIMEOUT, on_event=kill_on_event(world))
            except RankDied:
                event("crash: ranks SIGKILLed inside the save")
                stats.add("crashes (SIGKILL)")
                self.live = False
                self.inflight.add(self.step)
                if committed(self.root, self.step):
                    self.seen_committed.add(self.step)
                after = read_pointer(self.root)
                if after is not None and after != before:
                    text = after.decode("ascii", "replace").strip()
                    assert text.isdigit() and committed(self.root, int(text)), (
                        f"after a crash in the save of step {self.step} the pointer holds {after!r}: "
                        "torn, or published before the commit record")
                return
            assert errors == [None] * ws, f"save of step {self.step} failed without a fault: {errors}"
            event("crash: the save finished before the armed operation")
            stats.add("crash armed, save finished first")
            self.acked.add(self.step)

        def _damageable(self) -> list[int]:
            return sorted(s for s in (self.acked | self.inflight) - self.damaged if committed(self.root, s))

        @precondition(lambda self: not self.pending and self._damageable())
        @rule(data=st.data())
        def damage(self, data):
            s = data.draw(st.sampled_from(self._damageable()), label="step")
            how = data.draw(disk_damage(bitflip=False, commit_record=caps["record"]), label="damage")
            try:
                damage_step(step_path(self.root, s), how, data.draw(st.integers(0, 2**16), label="damage seed"))
            except FaultNotApplicable as e:  # e.g. no extra-state directory: nothing damaged
                event(f"damage not applicable: {type(e).__name__}")
                return
            self.damaged.add(s)
            stats.add("steps damaged")

        @precondition(lambda self: caps["pointer"] and not self.pending)
        @rule(how=pointer_damage())
        def damage_the_pointer(self, how):
            steps = sorted(self.acked | self.inflight) or [0]
            damage_pointer(self.root, how, steps)

        # -- resume ------------------------------------------------------------------------

        @rule(unprimed=st.booleans())
        def resume(self, unprimed):
            if not self.live:
                self.world = world_factory.get(ws)  # the crashed world is replaced by a fresh one
            unprimed = unprimed and caps["priming"] and self.cfg.sharding == "replicated"
            results = self.run(T.r_resume, self.cfg, checkpointer_spec, self.ck_kwargs, self.root, unprimed)
            if self.live:
                waits = [r["wait_error"] for r in results]
                assert waits == [None] * ws, f"async save failed: {waits}"
                self.acked |= self.pending
                self.pending.clear()
            self.live = True
            paths = {r["path"] for r in results}
            assert len(paths) == 1, f"ranks resumed from different checkpoints: {[r['path'] for r in results]}"
            path = paths.pop()
            required, allowed = self._expected()
            allowed_paths = {None if s is None else step_path(self.root, s) for s in allowed}
            assert path in allowed_paths, (
                f"resumed {path}; the newest complete step is {required} (acknowledged {sorted(self.acked)}, "
                f"crashed in flight {sorted(self.inflight)}, damaged {sorted(self.damaged)}, keep_last {self.keep_last})")
            for rank, r in enumerate(results):
                assert r["error"] is None, f"rank {rank}: resume from {path} raised {r['error']}"
                assert path is None or r["step"] == int(os.path.basename(path).rsplit("_", 1)[1]), (
                    f"rank {rank}: extra_state global_step {r['step']} in {path}")
                assert r["digest"] == r["reference"], (
                    f"rank {rank}: state restored from {path} differs from an uninterrupted run at step {r['step']}")
            self.step = results[0]["step"]
            stats.add("resumes")
            if path is not None and required in self.inflight - self.acked:
                stats.add("resumes onto a step in flight at a crash")
            event("resume: " + ("nothing to resume" if path is None else
                                "a step that was in flight at a crash" if required in self.inflight - self.acked else
                                "an acknowledged step") + (" (newer steps damaged)" if any(
                                    s > (required or -1) for s in self.damaged) else ""))

        def _owed(self) -> set[int]:
            """Acknowledged, undamaged steps that must still be complete: all of them without
            retention; with ``keep_last=k``, those with fewer than k newer steps that were ever
            complete (acknowledged, left complete by a crash, or an async save that may have
            committed already): retention, run when those
            committed, may rightly have removed the others even if we damaged the newer ones since."""
            kept = self.acked - self.damaged
            if self.keep_last is None:
                return kept
            ever = self.acked | self.seen_committed | self.pending  # a pending async save may have committed
            return {t for t in kept if sum(1 for u in ever if u > t) < self.keep_last}

        def _expected(self):
            required = set(self._owed())
            for s in self.inflight - self.damaged:
                if committed(self.root, s):
                    required.add(s)
            want = max(required, default=None)
            allowed = {want}
            if self.keep_last is not None:  # older acknowledged steps retention may or may not have removed
                allowed |= {s for s in self.acked - self.damaged - required
                            if (want is None or s > want) and committed(self.root, s)}
            return want, allowed

        @invariant()
        def no_acknowledged_save_lost(self):
            if not hasattr(self, "acked"):
                return
            lost = sorted(s for s in self._owed() if not committed(self.root, s))
            assert not lost, (f"acknowledged save(s) of step {lost} lost: "
                              + "; ".join(committed.why(self.root, s) for s in lost))

    run_state_machine_as_test(TrainingRun, settings=budget(request, stateful_step_count=12))
    armed = stats.counts.get("crashes (SIGKILL)", 0) + stats.counts.get("crash armed, save finished first", 0)
    if armed >= THIN_ARMED and not stats.counts.get("crashes (SIGKILL)", 0):
        advise(f"thin coverage: {armed} crashes were armed inside saves and none fired (the saves finished "
               "before the armed file-system operation: their writes are not seen by the harness' os hooks), "
               "so no SIGKILL inside a save was judged")
