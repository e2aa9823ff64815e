"""``refckpt convert`` of a ``torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()})``.

A plain ``opt.state_dict()`` keys its state by parameter index; the README's resume recipe
(``get_training_state`` -> ``load_latest`` -> ``set_training_state``, i.e. DCP's ``get_state_dict``)
asks for it by parameter name. Each test trains a real optimizer, saves it with ``torch.save``,
converts it through the command line (``main([...])``) or :func:`refckpt.tools.convert.convert`,
resumes a freshly built model and optimizer with the README's recipe, and compares every parameter,
buffer, moment, step counter and hyperparameter bit for bit with the live original objects, then one
more training step of both. Every original moment is checked to be non-zero first, so a resume that
leaves the moments at zero (the old behaviour, reproduced in
``test_without_the_renaming_the_moments_resume_as_zero``) cannot pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

import refckpt.tools.convert as convert_mod
from refckpt import DistributedCheckpointer, get_training_state, set_training_state
from refckpt.errors import CallerError
from refckpt.tools.cli import main
from refckpt.tools.convert import convert
from refckpt.tools.readers import read_state

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

ModelFactory = Callable[[int], torch.nn.Module]
OptFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
STEPS = 3


def run(capsys, *argv) -> tuple[int, str, str]:
    return B.run_main(main, capsys, *argv)


# -- models --------------------------------------------------------------------------------------
def mlp(seed: int) -> torch.nn.Module:
    return B.make_model(seed)


def batchnorm(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


class WithUnused(torch.nn.Module):
    """``unused`` sits between the two layers in parameter order and never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 5)
        self.unused = torch.nn.Linear(5, 5)
        self.b = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def with_unused(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return WithUnused()


class WithBuffer(torch.nn.Module):
    """A float buffer that no name tells from a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 5)
        self.register_buffer("scale", torch.full((5,), 0.5))
        self.b = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x) * self.scale))


def with_buffer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return WithBuffer()


class Tied(torch.nn.Module):
    """``head.weight`` is ``emb.weight``: two state-dict entries, one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def tied(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Tied()


# -- optimizers ----------------------------------------------------------------------------------
def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def adamw_amsgrad(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.8, 0.95))


def sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-3)


def adafactor(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(m.parameters(), lr=1e-2)  # row_var/col_var: not the parameter's shape


def two_groups(m: torch.nn.Module) -> torch.optim.Optimizer:
    """Biases (no weight decay) first, weights second: not the model's parameter order."""
    biases = [p for n, p in m.named_parameters() if n.endswith("bias")]
    weights = [p for n, p in m.named_parameters() if not n.endswith("bias")]
    return torch.optim.AdamW([{"params": biases, "weight_decay": 0.0}, {"params": weights}], lr=1e-2, weight_decay=0.1)


def reversed_order(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(m.parameters())[::-1], lr=1e-2, weight_decay=0.1)


def subset(m: torch.nn.Module) -> torch.optim.Optimizer:
    """The first layer is frozen and left out of the optimizer."""
    for p in m[0].parameters():
        p.requires_grad_(False)
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


# -- the round trip ------------------------------------------------------------------------------
def param_names_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The names in the optimizer's parameter order, as the help and README tell a user to write them."""
    return [n for g in opt.param_groups for p in g["params"] for n, q in model.named_parameters() if q is p]


def trained_save(tmp_path, make_model: ModelFactory, make_opt: OptFactory, opt_key: str = "optimizer"):
    """Train ``STEPS`` steps and torch.save {"model", opt_key}; returns (file, live model, live optimizer)."""
    model = make_model(0)
    opt = make_opt(model)
    B.train(model, opt, range(STEPS))
    path = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), opt_key: opt.state_dict()}, path)
    return path, model, opt


def assert_trained(opt: torch.optim.Optimizer) -> None:
    """Every state tensor of the original is non-zero and every step counter positive: a resume
    whose moments stayed at their initial zeros cannot compare equal to it."""
    assert opt.state, "the original optimizer has no state"
    for st in opt.state.values():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert value.abs().sum() > 0, f"{key} is zero in the original"


def resume(root, make_model: ModelFactory, make_opt: OptFactory):
    """The README's recipe, into a freshly built model (another seed: other weights) and optimizer."""
    model = make_model(99)
    opt = make_opt(model)
    state = get_training_state(model, opt, {})
    DistributedCheckpointer().load_latest(root, state)
    set_training_state(model, opt, state)
    return model, opt


def assert_same_training_state(model, opt, ref_model, ref_opt, stateless: tuple[int, ...] = ()) -> None:
    """Parameters and buffers, then the optimizer's state dict (state by index, step counters and
    every hyperparameter) bitwise. ``stateless``: ids the original holds no state for (never had a
    gradient): the resumed optimizer holds the zeros its own first step would start from."""
    B.assert_bitwise(B.params(model), B.params(ref_model), "model")
    got, want = opt.state_dict(), ref_opt.state_dict()
    for pid in stateless:
        assert pid not in want["state"]
        entries = got["state"].pop(pid, {})
        assert all(not torch.is_tensor(v) or not v.any() for v in entries.values()), f"id {pid}: {entries}"
    B.assert_bitwise(got, want, "optimizer")


def round_trip(capsys, tmp_path, make_model: ModelFactory, make_opt: OptFactory, *args: str,
               stateless: tuple[int, ...] = ()) -> str:
    """torch.save -> ``refckpt convert`` -> README resume -> bitwise, then one more step of both. Returns stdout."""
    path, model, opt = trained_save(tmp_path, make_model, make_opt)
    return convert_and_resume(capsys, path, model, opt, tmp_path / "root", make_model, make_opt, *args, stateless=stateless)


def convert_and_resume(capsys, path, model, opt, root, make_model: ModelFactory, make_opt: OptFactory, *args: str,
                       stateless: tuple[int, ...] = ()) -> str:
    """``refckpt convert path root *args``, then the README's resume compared with the live
    ``model`` and ``opt``, then one more step of both (``model`` and ``opt`` take it). Returns stdout."""
    assert_trained(opt)
    code, out, err = run(capsys, "convert", path, root, "--step", STEPS, *args)
    assert code == 0, err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh, fopt = resume(root, make_model, make_opt)
    absent = [str(w.message) for w in caught if "optimizer entries are absent" in str(w.message)]
    if stateless:  # only the parameters that never had a gradient are absent
        assert len(absent) == 1 and f"{len(stateless) * 3} optimizer entries" in absent[0], absent
    else:
        assert not absent, absent
    assert_same_training_state(fresh, fopt, model, opt, stateless)
    B.train(model, opt, range(STEPS, STEPS + 1))
    B.train(fresh, fopt, range(STEPS, STEPS + 1))
    assert_same_training_state(fresh, fopt, model, opt, stateless)
    return out


# ================================================================================================
# resumes bitwise
# ================================================================================================
OPTIMIZERS = [adamw, adamw_amsgrad, sgd] + ([adafactor] if hasattr(torch.optim, "Adafactor") else [])


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=lambda f: f.__name__)
def test_torch_save_resumes_every_moment_and_step_bitwise(capsys, tmp_path, make_opt):
    out = round_trip(capsys, tmp_path, mlp, make_opt)
    assert "optimizer state keyed by parameter name (4 parameters, paired in the model's parameter order)" in out


@pytest.mark.parametrize("make_opt", [adamw, sgd], ids=lambda f: f.__name__)
def test_converted_optimizer_is_what_get_state_dict_gives(capsys, tmp_path, make_opt):
    """The step holds exactly DCP's ``get_state_dict(model, opt)`` of the original: keys, tensors,
    hyperparameters and the params lists of names."""
    path, model, opt = trained_save(tmp_path, mlp, make_opt)
    root = tmp_path / "root"
    assert run(capsys, "convert", path, root)[0] == 0
    saved_opt = read_state(str(root / "global_step_0"), ["optimizer"], with_extra=False)["optimizer"]
    want_opt = get_state_dict(model, opt)[1]
    assert [g["params"] for g in saved_opt["param_groups"]] == [["0.weight", "0.bias", "2.weight", "2.bias"]]
    saved, want = convert_mod._flatten(saved_opt), convert_mod._flatten(want_opt)
    assert set(saved) == set(want)
    tensors = {k for k, v in want.items() if torch.is_tensor(v)}
    B.assert_bitwise({k: saved[k] for k in tensors}, {k: want[k] for k in tensors})
    assert {k: v for k, v in saved.items() if k not in tensors} == {k: v for k, v in want.items() if k not in tensors}


def test_without_the_renaming_the_moments_resume_as_zero(capsys, tmp_path, monkeypatch):
    """The defect, reproduced by writing the optimizer as the file holds it: the resume finds no
    entry for any parameter, warns, and keeps zero moments and step 0, which the comparison of the
    tests above rejects."""
    monkeypatch.setattr(convert_mod, "optimizer_by_name", lambda osd, model_sd, **kw: (osd, []))
    path, model, opt = trained_save(tmp_path, mlp, adamw)
    root = tmp_path / "root"
    assert run(capsys, "convert", path, root)[0] == 0
    with pytest.warns(UserWarning, match="optimizer entries are absent"):
        fresh, fopt = resume(root, mlp, adamw)
    B.assert_bitwise(B.params(fresh), B.params(model))
    for st in fopt.state.values():
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any() and st["step"] == 0
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_training_state(fresh, fopt, model, opt)


def test_batchnorm_buffers_are_not_paired_with_optimizer_ids(capsys, tmp_path):
    """1.running_mean, 1.running_var, 1.num_batches_tracked sit between 1.bias and 3.weight."""
    out = round_trip(capsys, tmp_path, batchnorm, adamw)
    assert "6 parameters" in out


def test_parameter_without_gradient_has_no_state_and_the_rest_pair_by_position(capsys, tmp_path):
    """ids 2 and 3 (unused.weight, unused.bias) hold no state; id 4 is b.weight, not the third
    state entry's neighbour."""
    out = round_trip(capsys, tmp_path, with_unused, adamw, stateless=(2, 3))
    assert "2 parameter(s) have no optimizer state (never had a gradient): unused.weight, unused.bias" in out


def test_tied_weight_counts_once(capsys, tmp_path):
    """``head.weight`` is ``emb.weight``: ``named_parameters`` (and so the optimizer) holds it once."""
    out = round_trip(capsys, tmp_path, tied, adamw)
    assert "3 parameters" in out


def test_already_name_keyed_optimizer_is_written_unchanged(capsys, tmp_path):
    model = mlp(0)
    opt = adamw(model)
    B.train(model, opt, range(STEPS))
    msd, osd = get_state_dict(model, opt)
    path = tmp_path / "dcp_style.pt"
    torch.save({"model": msd, "optimizer": osd}, path)
    root = tmp_path / "root"
    code, out, _ = run(capsys, "convert", path, root)
    assert code == 0 and "keyed by parameter name" not in out
    fresh, fopt = resume(root, mlp, adamw)
    assert_same_training_state(fresh, fopt, model, opt)
    names = tmp_path / "names.txt"
    names.write_text("\n".join(param_names_of(model, opt)) + "\n")
    code, _, err = run(capsys, "convert", path, tmp_path / "root2", "--param-names", names)
    assert code == 2 and "already keyed by parameter name" in err and str(names) in err


# ================================================================================================
# ambiguous pairings refuse, and --param-names resolves them
# ================================================================================================
@pytest.mark.parametrize("make_model,make_opt,want", [
    (mlp, two_groups, "the optimizer has 2 param groups"),
    (with_buffer, adamw, "the optimizer has 4 parameter(s) but the model state dict has 5 entries"),
    (mlp, subset, "the optimizer has 2 parameter(s) but the model state dict has 4 entries"),
    (mlp, reversed_order, "do not have the shape of their parameter"),
], ids=["two_groups", "float_buffer", "optimizer_over_a_subset", "out_of_order"])
def test_ambiguous_pairing_refuses_then_param_names_resume_bitwise(capsys, tmp_path, make_model, make_opt, want):
    path, model, opt = trained_save(tmp_path, make_model, make_opt)
    root = tmp_path / "root"
    code, out, err = run(capsys, "convert", path, root)
    assert code == 2 and out == ""
    assert want in err and str(path) in err and "--param-names FILE" in err and "named_parameters()" in err
    assert not root.exists()
    with pytest.raises(CallerError, match="--param-names"):
        convert(path, root)

    # through the API, with the names as a list
    res = convert(path, tmp_path / "api", param_names=param_names_of(model, opt))
    assert any("paired by param_names" in n for n in res.notes)
    fresh, fopt = resume(tmp_path / "api", make_model, make_opt)
    assert_same_training_state(fresh, fopt, model, opt)
    # through the command line, with the file the help tells a user to write
    names = tmp_path / "names.txt"
    names.write_text("\n".join(param_names_of(model, opt)) + "\n")
    out = convert_and_resume(capsys, path, model, opt, tmp_path / "cli", make_model, make_opt, "--param-names", names)
    assert f"paired by --param-names {names}" in out


def test_shape_mismatch_message_names_the_pairing(capsys, tmp_path):
    path, _model, _opt = trained_save(tmp_path, mlp, reversed_order)
    code, _, err = run(capsys, "convert", path, tmp_path / "root")
    assert code == 2
    assert "id 0 -> '0.weight': exp_avg [2], parameter [5, 4]" in err


@pytest.mark.parametrize("case", ["short", "long", "unknown", "duplicate", "missing_file", "wrong_order"])
def test_bad_param_names_file_refuses_naming_the_file(capsys, tmp_path, case):
    path, model, opt = trained_save(tmp_path, mlp, two_groups)
    names = param_names_of(model, opt)  # ['0.bias', '2.bias', '0.weight', '2.weight']
    file = tmp_path / "names.txt"
    if case == "short":
        names, want = names[:3], "lists 3 name(s) but the optimizer in"
    elif case == "long":
        names, want = names + ["0.weight"], "lists 5 name(s) but the optimizer in"
    elif case == "unknown":
        names, want = names[:3] + ["3.weight"], "names ['3.weight'], which are not tensors of the model state dict"
    elif case == "duplicate":
        names, want = names[:3] + ["0.bias"], "lists ['0.bias'] more than once"
    elif case == "wrong_order":
        names, want = sorted(names), "do not have the shape of their parameter"
    else:
        names, want = None, "cannot be read"
    if names is not None:
        file.write_text("# optimizer order\n" + "\n".join(names) + "\n\n")
    code, out, err = run(capsys, "convert", path, tmp_path / "root", "--param-names", file)
    assert code == 2 and out == "" and want in err, err
    assert str(file) in err
    if case != "wrong_order":
        assert "one parameter name per line" in err
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("case", ["plain_state_dict", "no_optimizer", "dcp_input"])
def test_param_names_where_there_is_nothing_to_pair_refuses(capsys, tmp_path, case):
    model = mlp(0)
    names = tmp_path / "names.txt"
    names.write_text("0.weight\n0.bias\n2.weight\n2.bias\n")
    src = tmp_path / "in.pt"
    if case == "plain_state_dict":
        torch.save(model.state_dict(), src)
    elif case == "no_optimizer":
        torch.save({"model": model.state_dict(), "epoch": 1}, src)
    else:
        src = tmp_path / "root"
        B.save(src, model, adamw(model), 1)
    code, _, err = run(capsys, "convert", src, tmp_path / "out", "--param-names", names)
    assert code == 2 and "--param-names" in err and "Drop the option" in err and str(src) in err


def test_other_optimizer_key_is_renamed_too(capsys, tmp_path):
    """``optimizer_state_dict`` (a common spelling) is found and re-keyed like ``optimizer``."""
    path, model, opt = trained_save(tmp_path, mlp, sgd, opt_key="optimizer_state_dict")
    root = tmp_path / "root"
    assert run(capsys, "convert", path, root)[0] == 0
    fresh, fopt = resume(root, mlp, sgd)
    assert_same_training_state(fresh, fopt, model, opt)
