"""Contract properties, in one process: newest complete step under any damage, bitwise round
trips over generated models/optimizers/dtypes, async snapshots, corruption never loads silently."""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from faults.strategies import DTYPES, OPTIMIZERS, build_model, damage_step, make_optimizer, payload_files

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _budget(request) -> settings:
    """``--fault-budget`` examples per property. ``FAULTS_SUITE_NO_SHRINK=1`` skips shrinking:
    a kill matrix only needs to know *that* a checkpointer fails, not its minimal example."""
    phases = [p for p in Phase if p is not Phase.shrink] if os.environ.get("FAULTS_SUITE_NO_SHRINK") else list(Phase)
    return settings(max_examples=request.config.getoption("--fault-budget"), deadline=None, phases=phases,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _state(model, opt, step):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "extra_state": {"global_step": step, "tag": f"s{step}"}}


def _apply(model, opt, state):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(model, opt) -> str:
    """Independent fingerprint: every parameter, every optimizer state tensor, every hyperparameter."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode() + _bytes(p))
    sd = opt.state_dict()
    for k in sorted(sd["state"]):
        for n, v in sorted(sd["state"][k].items()):
            h.update(n.encode() + (_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode()))
    h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]).encode())
    return h.hexdigest()


def _train(model, opt, steps):
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x = torch.randn(3, model[0].in_features, generator=g).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _fresh(kind, dtype, seed):
    model = build_model(seed, dtype)
    return model, make_optimizer(kind, model)


def test_resume_lands_on_newest_complete_step(checkpointer_factory, tmp_path_factory, request):
    """Save several steps, damage some (missing commit record, missing or truncated payload),
    corrupt the pointer: resume must pick the newest undamaged step and restore it bitwise."""

    @_budget(request)
    @given(steps=st.lists(st.integers(1, 50), min_size=1, max_size=4, unique=True).map(sorted), data=st.data())
    def prop(steps, data):
        root = str(tmp_path_factory.mktemp("root"))
        ck = checkpointer_factory()
        model, opt = _fresh("adamw", torch.float32, 0)
        digests, done = {}, 0
        for s in steps:
            _train(model, opt, range(done + 1, s + 1))
            done = s
            ck.save(root, _state(model, opt, s), global_step=s)
            digests[s] = _digest(model, opt)
        damaged = data.draw(st.sets(st.sampled_from(steps)), label="damaged")
        for s in sorted(damaged):
            damage_step(os.path.join(root, f"global_step_{s}"), data.draw(st.sampled_from(
                ["missing_commit", "missing_payload", "truncated_payload"]), label=f"damage {s}"))
        pointer = data.draw(st.sampled_from(["keep", "absent", "empty", "torn", "garbage", "dangling", "stale"]), label="pointer")
        _corrupt_pointer(root, pointer, steps)
        good = [s for s in steps if s not in damaged]
        got = ck.find_latest_checkpoint(root)
        assert got == (os.path.join(root, f"global_step_{good[-1]}") if good else None), (steps, damaged, pointer)
        if good:
            m2, o2 = _fresh("adamw", torch.float32, 1)
            state = _state(m2, o2, -1)
            ck.load(got, state)
            _apply(m2, o2, state)
            assert _digest(m2, o2) == digests[good[-1]]
            assert state["extra_state"]["global_step"] == good[-1]

    prop()


def _corrupt_pointer(root: str, how: str, steps: list[int]) -> None:
    p = os.path.join(root, "latest_checkpoint_iteration.txt")
    data = {"empty": b"", "torn": f"{steps[-1]}"[:-1].encode(), "garbage": b"x\x07!",
            "dangling": f"{steps[-1] + 1000}\n".encode(), "stale": f"{steps[0]}\n".encode()}
    if how == "absent":
        if os.path.exists(p):
            os.unlink(p)
    elif how in data:
        with open(p, "wb") as f:
            f.write(data[how])


def test_round_trip_is_bitwise(checkpointer_factory, tmp_path_factory, request):
    """Generated models, optimizers and dtypes: fresh objects restore bitwise, training continued
    from them equals the uninterrupted run."""

    @_budget(request)
    @given(kind=st.sampled_from(OPTIMIZERS), dtype=st.sampled_from(DTYPES), k=st.integers(1, 3),
           save_async=st.booleans())
    def prop(kind, dtype, k, save_async):
        root = str(tmp_path_factory.mktemp("rt"))
        ck = checkpointer_factory()
        model, opt = _fresh(kind, dtype, 0)
        _train(model, opt, range(1, k + 1))
        ck.save(root, _state(model, opt, k), global_step=k, save_async=save_async)
        ck.maybe_wait_for_async_save()
        want = _digest(model, opt)
        _train(model, opt, range(k + 1, k + 3))
        after = _digest(model, opt)
        m2, o2 = _fresh(kind, dtype, 1)
        state = _state(m2, o2, -1)
        ck.load(ck.find_latest_checkpoint(root), state)
        _apply(m2, o2, state)
        assert _digest(m2, o2) == want, (kind, dtype)
        _train(m2, o2, range(k + 1, k + 3))
        assert _digest(m2, o2) == after, (kind, dtype)

    prop()


def test_async_save_holds_values_at_the_call(checkpointer_factory, tmp_path):
    ck = checkpointer_factory()
    model, opt = _fresh("adamw", torch.float32, 0)
    _train(model, opt, range(1, 3))
    want = _digest(model, opt)
    ck.save(str(tmp_path), _state(model, opt, 2), global_step=2, save_async=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            for v in opt.state[p].values():
                v.add_(1.0)
    ck.maybe_wait_for_async_save()
    m2, o2 = _fresh("adamw", torch.float32, 1)
    state = _state(m2, o2, -1)
    ck.load(ck.find_latest_checkpoint(str(tmp_path)), state)
    _apply(m2, o2, state)
    assert _digest(m2, o2) == want


def test_corrupt_payload_never_loads_silently(checkpointer_factory, tmp_path):
    """A flipped bit in the payload (size intact) must make the load raise, not return wrong data."""
    ck = checkpointer_factory()
    model, opt = _fresh("adamw", torch.float32, 0)
    _train(model, opt, range(1, 3))
    ck.save(str(tmp_path), _state(model, opt, 2), global_step=2)
    step = os.path.join(str(tmp_path), "global_step_2")
    damage_step(step, "bitflip_payload")
    m2, o2 = _fresh("adamw", torch.float32, 1)
    state = _state(m2, o2, -1)
    with warnings.catch_warnings(), pytest.raises(Exception):
        warnings.simplefilter("ignore")
        ck.load(step, state)
