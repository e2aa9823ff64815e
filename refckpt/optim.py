"""Optimizer state that survives a checkpoint round trip.

A freshly built optimizer has *no* state: ``optimizer.state_dict()["state"]`` is
empty until the first ``step()``. DCP loads in place, into the tensors the state
dict already holds, so loading into a fresh optimizer loads nothing and training
resumes with zeroed Adam moments -- silently. :func:`initialize_optimizer_state`
materialises the state first.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["initialize_optimizer_state", "get_training_state", "set_training_state"]

log = logging.getLogger(__name__)


def _adam_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict:
    # Mirrors torch.optim.Adam._init_group so the first step after a load is
    # bitwise what it would have been after a lazy init.
    from torch.optim.optimizer import _get_scalar_dtype

    fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
    if fused or capturable:
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
    else:
        step = torch.tensor(0.0, dtype=_get_scalar_dtype())
    st = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _trainable(opt: torch.optim.Optimizer):
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                yield group, p


def _prime(opt: torch.optim.Optimizer) -> None:
    """One parameter-neutral step: zero grads, lr=0 and weight_decay=0, restored afterwards."""
    saved: list[dict[str, Any]] = []
    for group in opt.param_groups:
        saved.append({k: group[k] for k in ("lr", "weight_decay") if k in group})
        for k in ("lr", "weight_decay"):
            if k in group:
                group[k] = torch.zeros_like(group[k]) if isinstance(group[k], torch.Tensor) else 0.0
    for _g, p in _trainable(opt):
        p.grad = torch.zeros_like(p)
    try:
        with torch.no_grad():
            opt.step()
    finally:
        for group, old in zip(opt.param_groups, saved):
            group.update(old)
        for _g, p in _trainable(opt):
            p.grad = None


def _materialised(opt: torch.optim.Optimizer) -> bool:
    kind = type(opt)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return all(opt.state.get(p) for _g, p in _trainable(opt))
    if kind is torch.optim.SGD:
        return all("momentum_buffer" in opt.state.get(p, {}) for g, p in _trainable(opt) if g.get("momentum", 0))
    return bool(opt.state)


def _init_one(opt: torch.optim.Optimizer) -> bool:
    if _materialised(opt):
        return True
    kind = type(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        # Priming would consume the gradients; and a live optimizer mid-step has already built
        # the state it will ever have for its parameters. Either way: touch nothing, say so.
        msg = (f"initialize_optimizer_state: {type(opt).__name__} parameters already carry gradients; "
               f"nothing was changed. Call it before the first backward(), or after zero_grad(set_to_none=True).")
        warnings.warn(msg, stacklevel=3)
        log.warning(msg)
        return False
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        for group, p in _trainable(opt):
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = _adam_state(opt, group, p)
    elif kind is torch.optim.SGD:
        for group, p in _trainable(opt):
            if group.get("momentum", 0) and "momentum_buffer" not in opt.state.get(p, {}):
                # torch starts from None (buffer = grad); a zero buffer gives the same first
                # step when dampening == 0, which is torch's default.
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif not opt.state:
        _prime(opt)
        _reset_to_lazy_init(opt)
    return True


#: State entries whose lazy-init value is not zero: (optimizer class name, key) -> value from the
#: param group. Everything else a first step creates starts at zero (``step`` included).
_NONZERO_INIT = {
    ("NAdam", "mu_product"): lambda g: 1.0,
    ("Rprop", "step_size"): lambda g: g["lr"],
    ("ASGD", "eta"): lambda g: g["lr"],
    ("ASGD", "mu"): lambda g: 1.0,
}


def _reset_to_lazy_init(opt: torch.optim.Optimizer) -> None:
    """After :func:`_prime`, give every state entry the value the optimizer's own first step
    would have created: the priming step counted (``step`` 1, NAdam's ``mu_product``), and
    some entries derive from lr, which was 0 while priming (Rprop's step sizes, ASGD's eta)."""
    name = type(opt).__name__
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                if not st:
                    continue
                for key, value in list(st.items()):
                    init = _NONZERO_INIT.get((name, key))
                    if isinstance(value, torch.Tensor):
                        value.fill_(float(init(group)) if init is not None else 0)
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        st[key] = type(value)(init(group)) if init is not None else type(value)(0)


def initialize_optimizer_state(optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> bool:
    """Materialise the state of a fresh optimizer (or several) so that a load can fill it.

    AdamW/Adam (amsgrad included) and SGD with momentum get their state directly,
    exactly as their first step would create it. Any other ``torch.optim``
    optimizer is primed with one parameter-neutral step (lr=0, weight_decay=0,
    zero gradients; hyperparameters restored and gradients cleared afterwards), and its
    state is then reset to what its own first step would have created (counters 0, NAdam's
    ``mu_product`` 1, Rprop's step sizes and ASGD's eta from lr), so priming never changes
    how training proceeds.
    An optimizer whose state already exists is left alone.

    Returns False, with a warning, and changes nothing when parameters already
    carry gradients (priming would consume them). :func:`get_training_state`
    therefore initialises only optimizers without gradients: mid-training, a
    parameter that never had a gradient simply has no entry in the checkpoint,
    and a load keeps its zero state (with one warning that counts such entries).
    """
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    ok = True
    for opt in opts:
        ok = _init_one(opt) and ok
    return ok


def _as_list(optimizers) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def get_training_state(
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    extra_state: dict[str, Any] | None = None,
    *,
    options: Any = None,
) -> dict[str, Any]:
    """Build the ``state`` dict refckpt saves and loads, from live objects.

    Uses DCP's ``get_state_dict`` (plain modules, DDP, FSDP2/DTensor alike) after
    :func:`initialize_optimizer_state`, so a fresh optimizer has moments to load
    into. The model and optimizer entries alias the live tensors: a load fills
    them in place; call :func:`set_training_state` afterwards to apply the
    non-tensor parts (param-group hyperparameters).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    opts = _as_list(optimizers)
    state: dict[str, Any] = {}
    if opts:
        fresh = [o for o in opts if not any(p.grad is not None for g in o.param_groups for p in g["params"])]
        initialize_optimizer_state(fresh)
        model_sd, optim_sd = get_state_dict(model, opts, options=options)
        state["model"], state["optimizer"] = model_sd, optim_sd
    else:
        state["model"] = get_model_state_dict(model, options=options)
    if extra_state is not None:
        state["extra_state"] = extra_state
    return state


def set_training_state(
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    state: dict[str, Any],
    *,
    options: Any = None,
) -> dict[str, Any] | None:
    """Apply a loaded ``state`` back to the model and optimizer(s); returns its extra state."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    opts = _as_list(optimizers)
    if opts and "optimizer" in state:
        set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    return state.get("extra_state")
