"""Deferred (zero-stall) async saves, for checkpointers that declare
:attr:`~faults.contract.Capability.DEFERRED_SNAPSHOT`: ``save(..., save_async=True,
snapshot="deferred")`` returns before copying the state; the training loop goes on at once.

The property, in one process: Hypothesis interleaves random mutations -- optimizer steps,
forward passes of a model with BatchNorm buffers (train mode: the running statistics change),
in-place user ops on a parameter -- with deferred saves. Afterwards every acknowledged save
resumes bitwise to the values at its call, a save that raised left no commit record, and a save
followed by no in-place user op (only forward, backward and optimizer steps, which the contract
makes wait for the copy) is acknowledged: a checkpointer may not pass by refusing every save.
The oracle is the suite's own fingerprint of the state taken at each call."""

from __future__ import annotations

import hashlib
import warnings

import torch
from hypothesis import given
from hypothesis import strategies as st

from faults.contract import Capability as C
from faults.training import _errors, describe_error, tensor_bytes

from ._common import Completeness, Stats, budget, need, refused, same_path, step_path

#: what the training loop does between a deferred save's call and the wait: ``step`` (forward,
#: backward, optimizer step), ``forward`` (a forward only, BatchNorm in train mode), ``inplace``
#: (a user's in-place op on a parameter, outside optimizer.step and forward).
OPS = st.one_of(st.sampled_from(["step", "forward"]), st.tuples(st.just("inplace"), st.integers(0, 5)))


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batch(i: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 + i))


def _step(model, opt, i: int) -> None:
    opt.zero_grad(set_to_none=True)
    model(_batch(i)).pow(2).mean().backward()
    opt.step()


def _digest(model, opt) -> str:
    """Every parameter, buffer and optimizer state entry, bitwise, and the hyperparameters."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode() + tensor_bytes(v))
    for i, p in enumerate(model.parameters()):
        for k, v in sorted(opt.state.get(p, {}).items()):
            h.update(f"{i}/{k}".encode() + tensor_bytes(v))
    for g in opt.param_groups:
        h.update(repr(sorted((k, v) for k, v in g.items() if k != "params")).encode())
    return h.hexdigest()


def _state(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "extra_state": {"global_step": step}}


def _loaded_digest(ck, path: str) -> tuple[str, int]:
    """Load ``path`` into fresh objects (another seed; one step first, so the optimizer has every
    entry to fill: the caller primes, as the contract asks); (digest, extra-state step)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = _build(99)
    _step(model, opt, 99)
    state = _state(model, opt, -1)
    skeleton = state.pop("extra_state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ck.load(path, state, extra_state_skeleton=skeleton)
    state = out if isinstance(out, dict) else state
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return _digest(model, opt), int(state["extra_state"]["global_step"])


def test_deferred_save_holds_the_values_at_the_call_or_fails(checkpointer_factory, tmp_path_factory, request):
    need(checkpointer_factory, C.DEFERRED_SNAPSHOT)
    stats = Stats(request)

    @budget(request)
    @given(rounds=st.lists(st.lists(OPS, max_size=5), min_size=1, max_size=3), seed=st.integers(0, 3))
    def prop(rounds, seed):
        stats.add("examples")
        root = str(tmp_path_factory.mktemp("deferred"))
        model, opt = _build(seed)
        _step(model, opt, 0)
        params = list(model.parameters())
        ck = checkpointer_factory()
        at_call = dict[int, str]()
        acked = dict[int, bool]()
        i = 1
        try:
            for step, ops in enumerate(rounds, start=1):
                at_call[step] = _digest(model, opt)
                ok = True
                try:
                    ck.save(step_path(root, step), _state(model, opt, step), global_step=step, save_async=True,
                            snapshot="deferred")
                    for op in ops:
                        i += 1
                        if op == "step":
                            _step(model, opt, i)
                        elif op == "forward":
                            model(_batch(i))
                        else:
                            with torch.no_grad():
                                params[op[1] % len(params)].mul_(0.5)
                    ck.maybe_wait_for_async_save()
                except _errors() as e:  # noqa: BLE001 - judged below: a refused save must not be published
                    refused(e, "a deferred save")
                    ok = False
                    what = describe_error(e)
                    assert any(isinstance(op, tuple) for op in ops), (
                        f"deferred save of step {step} failed although the loop only ran {ops} (forward, "
                        f"backward and optimizer steps must wait for the copy, not fail it): {what}")
                acked[step] = ok
                stats.add("acknowledged" if ok else "refused (changed before the copy)")
            for step, ok in acked.items():
                if not ok:
                    assert not Completeness(checkpointer_factory)(root, step), (
                        f"step {step}: the save raised, yet the checkpointer takes it as complete")
                    continue
                got, extra_step = _loaded_digest(ck, step_path(root, step))
                assert extra_step == step, f"step {step}: extra_state global_step {extra_step}"
                assert got == at_call[step], (
                    f"step {step} (then {rounds[step - 1]}): the acknowledged deferred save does not hold the "
                    f"values at the call")
            newest = max((s for s, ok in acked.items() if ok), default=None)
            latest = ck.find_latest_checkpoint(root)
            assert same_path(latest, None if newest is None else step_path(root, newest)), (
                f"find_latest_checkpoint -> {latest}; the newest acknowledged save is step {newest}")
        finally:
            close = getattr(ck, "close", None)
            if callable(close):
                close()

    prop()
