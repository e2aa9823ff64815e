"""Optimizer state across a checkpoint: initialisation, the fresh-optimizer hazard, partial
state, the fp32 main-parameter branch, strict model loading, missing training state, and
bitwise exactness of a resumed run against an uninterrupted one.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import refckpt
from refckpt import DistributedCheckpointer, get_training_state, initialize_optimizer_state, set_training_state
from refckpt import errors as E

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- initialize_optimizer_state ----------------------------------------------------------------
ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("kind,keys", [
    ("adam", ADAM_KEYS),
    ("adamw", ADAM_KEYS),
    ("adam_amsgrad", ADAM_KEYS | {"max_exp_avg_sq"}),
    ("adamw_amsgrad", ADAM_KEYS | {"max_exp_avg_sq"}),
    ("sgd_nesterov", {"momentum_buffer"}),
])
def test_direct_init_matches_lazy_init(kind, keys):
    model, opt = B.make(0, kind)
    before = B.params(model)
    assert opt.state_dict()["state"] == {}
    assert initialize_optimizer_state(opt) is True
    B.assert_bitwise(B.params(model), before)
    for p in model.parameters():
        st = opt.state[p]
        assert set(st) == keys
        for k, v in st.items():
            if k == "step":
                assert v.item() == 0
            else:
                assert v.shape == p.shape and not v.any(), k
        assert p.grad is None

    # A real step from the initialised state equals a step from torch's own lazy init, bit for bit.
    lazy_model, lazy_opt = B.make(0, kind)
    for _ in range(2):
        B.train(model, opt, range(2))
        B.train(lazy_model, lazy_opt, range(2))
    B.assert_bitwise(B.params(model), B.params(lazy_model))
    B.assert_bitwise(opt.state_dict(), lazy_opt.state_dict())


@pytest.mark.parametrize("kind,keys", [("rmsprop", {"step", "square_avg", "momentum_buffer"}), ("adagrad", {"step", "sum"})])
def test_priming_is_parameter_neutral(kind, keys):
    model, opt = B.make(0, kind)
    opt.param_groups[0]["lr"] = 0.0375  # non-default values that priming must restore
    opt.param_groups[0]["weight_decay"] = 0.0125
    before = B.params(model)
    assert initialize_optimizer_state(opt) is True
    B.assert_bitwise(B.params(model), before)
    assert opt.param_groups[0]["lr"] == 0.0375 and type(opt.param_groups[0]["lr"]) is float
    assert opt.param_groups[0]["weight_decay"] == 0.0125
    for p in model.parameters():
        assert p.grad is None
        assert set(opt.state[p]) == keys
        for k, v in opt.state[p].items():
            if k != "step":
                if kind == "adagrad":
                    assert torch.equal(v, torch.full_like(p, opt.defaults["initial_accumulator_value"]))
                else:
                    assert not v.any(), k

    # Training continues exactly as without priming (moments and parameters; RMSprop's step
    # counter is one ahead after priming, which its update does not use).
    lazy_model, lazy_opt = B.make(0, kind)
    lazy_opt.param_groups[0].update(lr=0.0375, weight_decay=0.0125)
    B.train(model, opt, range(3))
    B.train(lazy_model, lazy_opt, range(3))
    B.assert_bitwise(B.params(model), B.params(lazy_model))
    for p, q in zip(model.parameters(), lazy_model.parameters()):
        for k in keys - {"step"}:
            B.assert_bitwise(opt.state[p][k], lazy_opt.state[q][k], k)


def test_several_optimizers():
    model = B.make_model(0)
    adamw = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    sgd = torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9)
    rms = torch.optim.RMSprop([torch.nn.Parameter(torch.ones(3))], lr=1e-2)
    assert initialize_optimizer_state([adamw, sgd, rms]) is True
    assert all(set(adamw.state[p]) == ADAM_KEYS for p in model[0].parameters())
    assert all(set(sgd.state[p]) == {"momentum_buffer"} for p in model[2].parameters())
    assert len(rms.state) == 1 and torch.equal(rms.param_groups[0]["params"][0], torch.ones(3))


def test_grads_present_refuses_priming():
    model, opt = B.make(0, "rmsprop")
    model(B.batch(0)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    before = B.params(model)
    with pytest.warns(UserWarning, match="already carry gradients"):
        assert initialize_optimizer_state(opt) is False
    assert opt.state_dict()["state"] == {}
    B.assert_bitwise(B.params(model), before)
    B.assert_bitwise([p.grad for p in model.parameters()], grads)


@pytest.mark.parametrize("kind", ["adamw", "sgd_nesterov"])
def test_grads_present_direct_kinds_also_refuse(kind):
    """The contract is uniform: gradients present -> False, one warning, nothing touched."""
    model, opt = B.make(0, kind)
    model(B.batch(0)).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="already carry gradients"):
        assert initialize_optimizer_state(opt) is False
    assert opt.state_dict()["state"] == {}
    B.assert_bitwise([p.grad for p in model.parameters()], grads)


@pytest.mark.parametrize("kind", ["adamw", "sgd_nesterov", "rmsprop"])
def test_frozen_params_get_no_state(kind):
    model, _ = B.make(0, kind)
    model[0].weight.requires_grad_(False)
    opt = B.OPTIMIZERS[kind](model.parameters())
    before = B.params(model)
    assert initialize_optimizer_state(opt) is True
    assert model[0].weight not in opt.state or not opt.state[model[0].weight]
    assert all(opt.state[p] for p in model.parameters() if p.requires_grad)
    B.assert_bitwise(B.params(model), before)
    assert model[0].weight.grad is None


def test_save_mid_step_with_unused_param_does_not_warn(tmp_path):
    """A trained model with a parameter that never gets a gradient, saved while grads are present."""
    model = _ModelWithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_unused(model, opt, range(2))  # leaves grads in place, like a loop that zero_grads first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        DistributedCheckpointer().save(tmp_path, get_training_state(model, opt, {"global_step": 2}), global_step=2)
    assert refckpt.find_latest_checkpoint(tmp_path) == str(tmp_path / "global_step_2")


@pytest.mark.parametrize("kind", ["adam", "adamw_amsgrad", "sgd_nesterov", "adagrad"])
def test_get_training_state_before_first_step_is_neutral(tmp_path, kind):
    """Saving at step 0 must not perturb training. (DCP's own get_state_dict primes a fresh
    optimizer with a real step, which leaves Adam's step counter at 1 and changes every
    later bias correction; refckpt's direct initialisation must not.)"""
    model, opt = B.make(0, kind)
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opt, {"global_step": 0}), global_step=0)
    lazy_model, lazy_opt = B.make(0, kind)
    B.train(model, opt, range(2))
    B.train(lazy_model, lazy_opt, range(2))
    B.assert_bitwise(B.params(model), B.params(lazy_model))
    B.assert_bitwise(opt.state_dict(), lazy_opt.state_dict())


# -- the fresh-optimizer hazard ---------------------------------------------------------------------
def _fqn_optim_sd(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with parameter names instead of ids (what a naive checkpointer saves)."""
    names = {id(p): n for n, p in model.named_parameters()}
    ids = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()
    return {
        "state": {ids[i]: v for i, v in sd["state"].items()},
        "param_groups": [{**g, "params": [ids[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def _from_fqn_optim_sd(model, opt, fqn_sd) -> None:
    names = [n for n, _ in model.named_parameters()]
    index = {n: i for i, n in enumerate(names)}
    opt.load_state_dict({
        "state": {index[n]: v for n, v in fqn_sd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in fqn_sd["param_groups"]],
    })


def test_fresh_optimizer_hazard(tmp_path):
    k = 3
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(k))
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opt, {"global_step": k}), global_step=k)
    step_dir = str(tmp_path / f"global_step_{k}")
    saved_exp_avg = opt.state[model[0].weight]["exp_avg"].clone()
    assert saved_exp_avg.abs().sum() > 0
    B.train(model, opt, range(k, k + 1))  # the uninterrupted run
    ref_params, ref_opt = B.params(model), B.opt_snapshot(opt)

    # Naive, on plain DCP: a fresh optimizer's own state_dict has no moments, so the load has
    # nowhere to put them.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from refckpt.storage import SafetensorsReader

    naive_model, naive_opt = B.make(99, "adamw")
    assert naive_opt.state_dict()["state"] == {}
    naive = {"model": naive_model.state_dict(), "optimizer": _fqn_optim_sd(naive_model, naive_opt)}
    dcp.load(naive, storage_reader=SafetensorsReader(step_dir), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    naive_model.load_state_dict(naive["model"])
    _from_fqn_optim_sd(naive_model, naive_opt, naive["optimizer"])
    assert naive_opt.state_dict()["state"] == {}  # nothing of the moments was loaded
    B.train(naive_model, naive_opt, range(k, k + 1))
    assert not torch.equal(naive_opt.state[naive_model[0].weight]["exp_avg"], ref_opt["state"][0]["exp_avg"])
    assert naive_opt.state[naive_model[0].weight]["step"].item() == 1  # restarted from zeroed moments
    assert any(not torch.equal(a, b) for a, b in zip(B.params(naive_model).values(), ref_params.values()))

    # refckpt's load gives the parameters without state the checkpoint's entries, so the very
    # same unprimed state dict restores the moments.
    m2, o2 = B.make(99, "adamw")
    unprimed = {"model": m2.state_dict(), "optimizer": _fqn_optim_sd(m2, o2)}
    DistributedCheckpointer().load(step_dir, unprimed)
    m2.load_state_dict(unprimed["model"])
    _from_fqn_optim_sd(m2, o2, unprimed["optimizer"])
    B.assert_bitwise(o2.state[m2[0].weight]["exp_avg"], saved_exp_avg)
    B.train(m2, o2, range(k, k + 1))
    B.assert_bitwise(B.params(m2), ref_params)

    # get_training_state initialises first, so the same checkpoint restores the moments.
    good_model, good_opt = B.make(99, "adamw")
    state = get_training_state(good_model, good_opt, {})
    DistributedCheckpointer().load(step_dir, state)
    set_training_state(good_model, good_opt, state)
    B.assert_bitwise(good_opt.state[good_model[0].weight]["exp_avg"], saved_exp_avg)
    B.train(good_model, good_opt, range(k, k + 1))
    B.assert_bitwise(B.params(good_model), ref_params)
    B.assert_bitwise(good_opt.state_dict(), ref_opt)


# -- partial optimizer state ---------------------------------------------------------------------
class _ModelWithUnused(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)  # trainable, but forward() never reaches it

    def forward(self, x):
        return self.head(torch.tanh(self.frozen(x)))


def _train_unused(model, opt, steps):
    for s in steps:
        opt.zero_grad(set_to_none=True)
        model(B.batch(s)).pow(2).mean().backward()
        opt.step()


def test_partial_optimizer_state_warns_once_and_keeps_zeros(tmp_path):
    model = _ModelWithUnused(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_unused(model, opt, range(3))
    assert model.unused.weight not in opt.state and model.frozen.weight not in opt.state
    # Saved the way DCP alone would (no initialisation): entries exist only where a step made them.
    msd, osd = get_state_dict(model, opt)
    DistributedCheckpointer().save(tmp_path, {"model": msd, "optimizer": osd, "extra_state": {}}, global_step=3)
    ref_params, ref_opt = B.params(model), B.opt_snapshot(opt)

    fresh = _ModelWithUnused(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = get_training_state(fresh, fresh_opt, {})
    # initialisation created 3 entries (step, exp_avg, exp_avg_sq) for each of unused.weight/bias
    with pytest.warns(UserWarning, match=r"\b6 optimizer entries are absent") as rec:
        DistributedCheckpointer().load(tmp_path / "global_step_3", state)
    assert len([w for w in rec if "absent" in str(w.message)]) == 1
    assert "unused.weight" in str([w.message for w in rec if "absent" in str(w.message)][0])
    set_training_state(fresh, fresh_opt, state)

    B.assert_bitwise(B.params(fresh), ref_params)
    for name in ("unused.weight", "unused.bias"):
        st = fresh_opt.state[fresh.get_parameter(name)]
        assert st["step"].item() == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    assert not fresh_opt.state.get(fresh.frozen.weight)
    got = fresh_opt.state_dict()
    names = [n for n, p in model.named_parameters()]
    pos = {n: i for i, n in enumerate(names)}
    for i, st in ref_opt["state"].items():
        B.assert_bitwise(got["state"][i], st, names[i])
    assert set(got["state"]) == set(ref_opt["state"]) | {pos["unused.weight"], pos["unused.bias"]}

    # and training on matches the uninterrupted run (the unused parameter never moves)
    _train_unused(model, opt, range(3, 5))
    _train_unused(fresh, fresh_opt, range(3, 5))
    B.assert_bitwise(B.params(fresh), B.params(model))


# -- fp32 main-parameter branch ------------------------------------------------------------------
def _main_params(model, offset: float) -> dict:
    return {n: (p.detach().double() + offset).float() for n, p in model.named_parameters()}


def _save_with_branch(root, model, opt, branch):
    state = get_training_state(model, opt, {"global_step": 1})
    if branch is not None:
        state["fp32_main_params"] = branch
    DistributedCheckpointer().save(root, state, global_step=1)
    return str(root / "global_step_1")


def test_main_params_all_present_loaded_bitwise(tmp_path):
    model, opt = B.make(0, "adamw")
    saved = _main_params(model, 0.25)
    step = _save_with_branch(tmp_path, model, opt, B.clone_tree(saved))
    fresh, fopt = B.make(9, "adamw")
    state = get_training_state(fresh, fopt, {})
    state["fp32_main_params"] = {n: torch.zeros_like(t) for n, t in saved.items()}
    DistributedCheckpointer().load(step, state)
    B.assert_bitwise(state["fp32_main_params"], saved)


def test_main_params_absent_branch_is_dropped(tmp_path):
    model, opt = B.make(0, "adamw")
    step = _save_with_branch(tmp_path, model, opt, None)
    fresh, fopt = B.make(9, "adamw")
    state = get_training_state(fresh, fopt, {})
    sentinel = _main_params(fresh, -7.0)
    state["fp32_main_params"] = B.clone_tree(sentinel)
    DistributedCheckpointer().load(step, state)
    B.assert_bitwise(state["fp32_main_params"], sentinel)  # untouched
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), B.params(model))  # the rest loaded


def test_main_params_partial_branch_fails_naming_missing(tmp_path):
    model, opt = B.make(0, "adamw")
    full = _main_params(model, 0.25)
    names = sorted(full)
    kept, dropped = names[::2], names[1::2]
    step = _save_with_branch(tmp_path, model, opt, {n: full[n] for n in kept})
    fresh, fopt = B.make(9, "adamw")
    state = get_training_state(fresh, fopt, {})
    state["fp32_main_params"] = {n: torch.zeros_like(t) for n, t in full.items()}
    with pytest.raises(E.MissingKeysError) as ei:
        DistributedCheckpointer().load(step, state)
    msg = str(ei.value)
    assert step in msg and f"lacks {len(dropped)}" in msg
    for n in dropped:
        assert f"fp32_main_params.{n}" in msg
    for n in kept:
        assert f"fp32_main_params.{n}'" not in msg


# -- strict model ----------------------------------------------------------------------------------
def test_strict_model_missing_keys(tmp_path):
    model, opt = B.make(0, "adamw")
    step = B.save(tmp_path, model, opt, 1)
    saved = B.params(model)

    bigger = B.make_model(9)
    bigger.register_parameter("extra_param", torch.nn.Parameter(torch.full((2,), 3.0)))
    with pytest.raises(E.MissingKeysError, match="model.extra_param") as ei:
        DistributedCheckpointer().load(step, {"model": bigger.state_dict()})
    assert step in str(ei.value) and "strict_model=False" in str(ei.value)

    DistributedCheckpointer().load(step, {"model": bigger.state_dict()}, strict_model=False)
    got = B.params(bigger)
    assert torch.equal(got.pop("extra_param"), torch.full((2,), 3.0))
    B.assert_bitwise(got, saved)


def test_strict_model_lists_at_most_ten(tmp_path):
    model, opt = B.make(0, "adamw")
    step = B.save(tmp_path, model, opt, 1)
    bigger = B.make_model(9)
    for i in range(15):
        bigger.register_buffer(f"missing_{i:02d}", torch.zeros(1))
    with pytest.raises(E.MissingKeysError) as ei:
        DistributedCheckpointer().load(step, {"model": bigger.state_dict()})
    msg = str(ei.value)
    assert "15 model keys missing" in msg
    assert len(re.findall(r"'model\.missing_\d\d'", msg)) == 10
    assert "5 more" in msg


# -- missing training state -------------------------------------------------------------------------
def test_missing_extra_state(tmp_path):
    model, opt = B.make(0, "adamw")
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opt), global_step=1)
    step = str(tmp_path / "global_step_1")
    fresh, fopt = B.make(9, "adamw")
    with pytest.raises(E.MissingTrainingStateError) as ei:
        DistributedCheckpointer().load(step, get_training_state(fresh, fopt, {}))
    msg = str(ei.value)
    assert step in msg and "weights only" in msg and "extra_state" in msg
    assert isinstance(ei.value, KeyError)
    state = get_training_state(fresh, fopt)  # no extra_state asked for: works
    DistributedCheckpointer().load(step, state)
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), B.params(model))


def test_missing_optimizer(tmp_path):
    model, _opt = B.make(0, "adamw")
    DistributedCheckpointer().save(tmp_path, get_training_state(model, None, {"global_step": 1}), global_step=1)
    step = str(tmp_path / "global_step_1")
    fresh, fopt = B.make(9, "adamw")
    with pytest.raises(E.MissingTrainingStateError) as ei:
        DistributedCheckpointer().load(step, get_training_state(fresh, fopt, {}))
    msg = str(ei.value)
    assert step in msg and "optimizer" in msg and "weights only" in msg
    sd = fresh.state_dict()
    DistributedCheckpointer().load(step, {"model": sd})
    B.assert_bitwise({k: v for k, v in sd.items()}, B.params(model))


# -- exactness ----------------------------------------------------------------------------------------
def _build(seed: int, kind: str):
    model = B.make_model(seed)
    if kind == "two":
        return model, [torch.optim.AdamW(model[0].parameters(), lr=1e-2, amsgrad=True),
                       torch.optim.SGD(model[2].parameters(), lr=1e-2, momentum=0.9, nesterov=True)]
    return model, [B.OPTIMIZERS[kind](model.parameters())]


def _extra(step: int) -> dict:
    torch.manual_seed(1234 + step)
    torch.rand(3)
    return {
        "global_step": step,
        "rng": torch.get_rng_state(),
        "data": {"epoch": 2, "offsets": [3, 1, [4, 1, 5]], "name": "shard-β", "weights": [0.5, 0.25]},
        "scheduler": {"last_epoch": step, "base_lrs": [0.01, 0.02]},
        "counts": torch.arange(4, dtype=torch.int64),
    }


@pytest.mark.parametrize("kind,per_rank", [
    ("adamw_amsgrad", True), ("sgd_nesterov", True), ("rmsprop", True), ("adagrad", True), ("two", True),
    ("adamw_amsgrad", False),  # extra state embedded in the DCP payload
])
def test_resume_is_bitwise_exact(tmp_path, kind, per_rank):
    model, opts = _build(0, kind)
    B.train(model, opts, range(3))
    for o in opts:  # a scheduler moved lr: the fresh optimizer's default must be overwritten
        o.param_groups[0]["lr"] = 0.0073
    extra = _extra(3)
    saved_extra = B.clone_tree(extra)
    saved_params = B.params(model)
    saved_opts = [B.opt_snapshot(o) for o in opts]
    DistributedCheckpointer(extra_state_per_rank=per_rank).save(
        tmp_path, get_training_state(model, opts, extra), global_step=3)
    B.assert_bitwise(extra, saved_extra)  # save does not mutate the caller's extra state

    B.train(model, opts, range(3, 6))  # uninterrupted
    ref_params, ref_opts = B.params(model), [B.opt_snapshot(o) for o in opts]

    fresh, fopts = _build(77, kind)
    state = get_training_state(fresh, fopts, {})
    path = DistributedCheckpointer(extra_state_per_rank=per_rank).load_latest(tmp_path, state)
    assert path == str(tmp_path / "global_step_3")
    got_extra = set_training_state(fresh, fopts, state)
    B.assert_bitwise(B.params(fresh), saved_params)
    for o, snap in zip(fopts, saved_opts):
        B.assert_bitwise(o.state_dict(), snap)
        assert o.param_groups[0]["lr"] == 0.0073
    B.assert_bitwise(got_extra, saved_extra)

    B.train(fresh, fopts, range(3, 6))
    B.assert_bitwise(B.params(fresh), ref_params)
    for o, ref in zip(fopts, ref_opts):
        B.assert_bitwise(o.state_dict(), ref)


def test_restored_rng_state_reproduces_draws(tmp_path):
    model, opts = _build(0, "adamw_amsgrad")
    torch.manual_seed(42)
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opts, {"rng": torch.get_rng_state()}), global_step=1)
    expected = torch.rand(5)
    torch.manual_seed(0)
    state = get_training_state(*_build(1, "adamw_amsgrad"), {})
    DistributedCheckpointer().load(tmp_path / "global_step_1", state)
    torch.set_rng_state(state["extra_state"]["rng"])
    B.assert_bitwise(torch.rand(5), expected)
    assert state["extra_state"]["global_step"] == 1


def test_list_of_optimizer_state_dicts(tmp_path):
    """``state["optimizer"]`` may be a list, one state dict per optimizer (e.g. one for the
    embeddings, one for the rest); each comes back bitwise into its own optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def build(seed):
        model = B.make_model(seed)
        first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
        return model, [torch.optim.AdamW(first, lr=1e-2), torch.optim.SGD(rest, lr=1e-2, momentum=0.9)]

    model, opts = build(0)
    B.train(model, opts, range(3))
    state = {"model": model.state_dict(), "optimizer": [get_optimizer_state_dict(model, o) for o in opts],
             "extra_state": {"global_step": 3}}
    DistributedCheckpointer().save(tmp_path, state, global_step=3)
    model2, opts2 = build(1)
    initialize_optimizer_state(opts2)
    state2 = {"model": model2.state_dict(), "optimizer": [get_optimizer_state_dict(model2, o) for o in opts2],
              "extra_state": {}}
    DistributedCheckpointer().load_latest(tmp_path, state2)
    for o, sd in zip(opts2, state2["optimizer"]):
        set_optimizer_state_dict(model2, o, sd)
    B.assert_bitwise(B.params(model2), B.params(model))
    for a, b in zip(opts, opts2):
        B.assert_bitwise(b.state_dict(), a.state_dict())
    assert state2["extra_state"]["global_step"] == 3


# -- model / optimizer -----------------------------------------------------------------------------
def test_model_shape_mismatch_is_not_reported_as_corruption(ckpt):
    root, _s4, s42 = ckpt
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    state = {"model": wider.state_dict()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(E.CheckpointError) as ei:
            DistributedCheckpointer().load_latest(root, state)
    msg = str(ei.value)
    # Not damage: the user's model does not match, so no fallback and no "restore from a copy".
    assert not isinstance(ei.value, E.CorruptCheckpointError), msg
    assert "model.0.weight" in msg and s42 in msg
    assert not [w for w in caught if "fall back" in str(w.message)]


def test_fused_adamw_direct_init_matches_lazy_init():
    model = B.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert initialize_optimizer_state(opt) is True
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert step.shape == () and step.dtype == torch.float32 and step.device == p.device and step.item() == 0
        assert p.grad is None
    lazy_model = B.make_model(0)
    lazy_opt = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    B.train(model, opt, range(3))
    B.train(lazy_model, lazy_opt, range(3))
    B.assert_bitwise(B.params(model), B.params(lazy_model))
    B.assert_bitwise(opt.state_dict(), lazy_opt.state_dict())


@pytest.mark.parametrize("kind,keys", [("adamw", {"step", "exp_avg", "exp_avg_sq"}), ("sgd_nesterov", {"momentum_buffer"})])
def test_init_fills_only_parameters_without_state(kind, keys):
    """Mid-training, a parameter added later (or never used so far) gets state; the others keep theirs."""
    model = B.make_model(0)
    late = torch.nn.Parameter(torch.ones(3))
    opt = B.OPTIMIZERS[kind](list(model.parameters()) + [late])
    B.train(model, opt, range(2))  # `late` is not in the graph: no grad, no state
    opt.zero_grad(set_to_none=True)
    assert late not in opt.state or not opt.state[late]
    existing = {n: B.clone_tree(opt.state[p]) for n, p in model.named_parameters()}
    assert initialize_optimizer_state(opt) is True
    for n, p in model.named_parameters():
        B.assert_bitwise(opt.state[p], existing[n], n)
    assert set(opt.state[late]) == keys
    assert all(not v.any() for v in opt.state[late].values())
    assert torch.equal(late, torch.ones(3)) and late.grad is None


def test_priming_an_optimizer_without_weight_decay_is_parameter_neutral():
    model = B.make_model(0)
    opt = torch.optim.Rprop(model.parameters(), lr=0.0375)
    assert "weight_decay" not in opt.param_groups[0]
    before = B.params(model)
    assert initialize_optimizer_state(opt) is True
    B.assert_bitwise(B.params(model), before)
    assert opt.param_groups[0]["lr"] == 0.0375 and "weight_decay" not in opt.param_groups[0]
    assert all(set(opt.state[p]) >= {"step", "prev", "step_size"} and p.grad is None for p in model.parameters())


PRIMED = {
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
}


@pytest.mark.parametrize("kind", sorted(PRIMED))
def test_saving_before_the_first_step_does_not_perturb_primed_optimizers(tmp_path, kind):
    model = B.make_model(0)
    opt = PRIMED[kind](model.parameters())
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opt, {}), global_step=0)
    lazy_model = B.make_model(0)
    lazy_opt = PRIMED[kind](lazy_model.parameters())
    B.train(model, opt, range(3))
    B.train(lazy_model, lazy_opt, range(3))
    B.assert_bitwise(B.params(model), B.params(lazy_model))


@pytest.mark.parametrize("with_opt", [False, True])
def test_weights_only_state_round_trips(tmp_path, with_opt):
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    weights = B.params(model)
    state = get_training_state(model)
    assert set(state) == {"model"}
    DistributedCheckpointer().save(tmp_path, state, global_step=2)

    fresh, fopt = B.make(99, "adamw")
    fopt_before = B.opt_snapshot(fopt)
    loaded = get_training_state(fresh)
    DistributedCheckpointer().load(str(tmp_path / "global_step_2"), loaded)
    assert set_training_state(fresh, fopt if with_opt else None, loaded) is None  # no extra state
    B.assert_bitwise(B.params(fresh), weights)
    B.assert_bitwise(B.opt_snapshot(fopt), fopt_before)  # an optimizer passed along is left alone
