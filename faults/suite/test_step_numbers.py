"""Step numbers: whatever step a save acknowledges, resume finds and restores it (issue 29: steps
-1, ``True`` and 2**64 were acknowledged and then never found, because the suite only ever saved
small step numbers). Refusing a step at save is fine; acknowledging one that is then invisible
loses that save.

Each example is a fresh root holding one step, saved under the drawn number from the state of a
run trained one step (its extra state's ``global_step`` is the drawn number); resume must land on
that step directory and restore the state bitwise (parameters, moments, RNG) with that
``global_step``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from faults.training import RunConfig, TrainRun, _errors, describe_error

from ._common import Stats, budget, config_for, refused, resume, same_path, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig(extra_per_rank=False)
#: the edges: the first step, 32- and 64-bit limits on both sides, the negative, a bool
BOUNDARIES = (0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -1, True)


def test_any_acknowledged_step_number_is_found_and_restored(checkpointer_factory, tmp_path_factory, request):
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, CFG)

    @budget(request, scale=2)
    @given(step=st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 10**12)))
    @example(step=-1)
    @example(step=2**64)
    @example(step=True)
    def prop(step):
        stats.add("examples")
        root = str(tmp_path_factory.mktemp("steps"))
        run = TrainRun(cfg)
        run.train_to(1)
        state = run.state()
        state["extra_state"] = {**state["extra_state"], "global_step": step}
        path = step_path(root, step)
        try:
            checkpointer_factory().save(path, state, global_step=step)
        except _errors() as e:  # noqa: BLE001 - refusing a step number is fine
            refused(e, f"a save of step {step!r}")
            stats.add("refused at save")
            return
        stats.add("acknowledged")
        found, resumed = resume(checkpointer_factory(), root, cfg)
        assert same_path(found, path), (
            f"save of step {step!r} into {os.path.basename(path)} was acknowledged, and resume found {found!r}: "
            "an acknowledged save that is never found is lost (refuse the step number at save instead)")
        ref = TrainRun(cfg)
        ref.train_to(1)
        ref.step = int(step)
        assert resumed.step == int(step) and resumed.digest() == ref.digest(), (
            f"step {step!r}: the restored state differs from the one saved (global_step {resumed.step})")

    try:
        prop()
    except AssertionError:
        raise
    except _errors() as e:  # noqa: BLE001 - a resume that raised: its own message
        raise AssertionError(describe_error(e)) from e
