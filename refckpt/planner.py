"""Load rules, as a DCP ``LoadPlanner``.

* The model must be complete unless ``strict_model=False``; the error names up to 10 missing keys.
* Optimizer entries absent from the checkpoint (frozen parameters, parameters that
  never had a gradient, unrouted MoE experts, a save before the first step) keep
  their current -- zero-initialised -- values, with one warning that counts them.
* The mixed-precision fp32 main-parameter branch: all present -> loaded; none
  present -> dropped from the load (logged); some present -> error naming the missing.
* Non-tensor items are read with ``torch.load(weights_only=True)`` (DCP's default
  planner unpickles them without restriction, which executes code from the checkpoint).
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .errors import MissingKeysError, MissingTrainingStateError, ShapeMismatchError
from .safeload import safe_torch_load

__all__ = ["RefLoadPlanner", "MODEL_KEY", "OPTIMIZER_KEY", "EXTRA_STATE_KEY", "MAIN_PARAMS_KEY", "format_keys"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EXTRA_STATE_KEY = "extra_state"
MAIN_PARAMS_KEY = "fp32_main_params"
_SHOW = 10


def format_keys(keys: Iterable[str], limit: int = _SHOW) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


class RefLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with refckpt's completeness rules and safe byte loading."""

    def __init__(
        self,
        *,
        checkpoint_path: str = "",
        strict_model: bool = True,
        main_params_key: str = MAIN_PARAMS_KEY,
        safe_globals: tuple = (),
    ) -> None:
        # allow_partial_load=True: this planner prunes what may be absent itself and
        # raises for the rest, with messages that name the checkpoint and the fix.
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=True)
        self.checkpoint_path = checkpoint_path
        self.strict_model = strict_model
        self.main_params_key = main_params_key
        self.safe_globals = safe_globals
        self.skipped_optimizer_entries = 0

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            self.materialised_optimizer_entries = materialise_unprimed_optimizer_state(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def _top(self, flat_key: str) -> str:
        path = self.mappings.get(flat_key) if self.mappings else None
        return str(path[0]) if path else flat_key.split(".", 1)[0]

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        saved_tops = {k.split(".", 1)[0] for k in saved}
        missing: dict[str, list[str]] = {}
        present: dict[str, int] = {}
        for key in self.state_dict:
            top = self._top(key)
            if key in saved:
                present[top] = present.get(top, 0) + 1
            else:
                missing.setdefault(top, []).append(key)
        path = self.checkpoint_path
        drop: list[str] = []
        for top, keys in missing.items():
            if top == OPTIMIZER_KEY:
                if OPTIMIZER_KEY not in saved_tops:
                    raise MissingTrainingStateError(
                        f"{path}: checkpoint holds no optimizer state. To load weights only, pass a "
                        f"state without 'optimizer' (e.g. {{'model': model_state_dict}})."
                    )
                self.skipped_optimizer_entries = len(keys)
                msg = (f"{path}: {len(keys)} optimizer entries are absent from the checkpoint and keep "
                       f"their initial (zero) values: {format_keys(keys, 5)}. Expected for frozen "
                       f"parameters, parameters that never had a gradient, and saves before the first step.")
                warnings.warn(msg, stacklevel=2)
                log.warning(msg)
                drop += keys
            elif top == self.main_params_key:
                if present.get(top, 0) == 0:
                    log.info("%s: no %s in the checkpoint; that branch is dropped from the load", path, top)
                    drop += keys
                else:
                    raise MissingKeysError(
                        f"{path}: the checkpoint has {present[top]} of the fp32 main parameters under "
                        f"{top!r} but lacks {len(keys)}: {format_keys(keys)}. A partial branch cannot be "
                        f"trusted; re-save it whole, or drop {top!r} from the state to rebuild it from the model."
                    )
            elif top == MODEL_KEY and not self.strict_model:
                log.warning("%s: %d model keys missing, kept as they are: %s", path, len(keys), format_keys(keys))
                drop += keys
            else:
                what = "model keys" if top == MODEL_KEY else f"keys under {top!r}"
                raise MissingKeysError(
                    f"{path}: {len(keys)} {what} missing from the checkpoint: {format_keys(keys)}. "
                    f"Check that the model matches the checkpoint"
                    + (", or pass strict_model=False to load the keys that exist." if top == MODEL_KEY else ".")
                )
        for key in drop:
            del self.state_dict[key]
        self._check_shapes(saved)
        return create_default_local_load_plan(self.state_dict, self.metadata, True)

    def _check_shapes(self, saved) -> None:
        """Tensors the load would fill must have the saved shape: otherwise the model does not
        match (a user error, named here), which is not damage to fall back from."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        bad = []
        for key, value in self.state_dict.items():
            smd = saved.get(key)
            if isinstance(smd, TensorStorageMetadata) and isinstance(value, torch.Tensor):
                if tuple(value.shape) != tuple(smd.size):
                    bad.append(f"{key!r}: checkpoint {tuple(smd.size)}, state {tuple(value.shape)}")
        if bad:
            raise ShapeMismatchError(
                f"{self.checkpoint_path}: {len(bad)} tensors differ in shape from the checkpoint: "
                f"{', '.join(sorted(bad)[:_SHOW])}{' ...' if len(bad) > _SHOW else ''}. The model (or "
                f"optimizer) was built differently from the one that saved it; build the same "
                f"architecture and configuration, or load into a state without those keys."
            )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"{self.checkpoint_path} (item {fqn})", self.safe_globals)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:  # pragma: no cover - this planner always flattens
            self.state_dict[fqn] = obj


def materialise_unprimed_optimizer_state(state_dict: dict[str, Any], metadata: Any) -> int:
    """Give every parameter that has *no* optimizer state in ``state_dict`` the entries the
    checkpoint holds for it, as empty tensors of the saved shape and dtype that the load then
    fills (non-tensor entries as placeholders). Returns how many entries were added.

    Without this, an optimizer state dict taken before the first step (``"state": {}``) loads
    nothing and training resumes with zeroed moments. Parameters that do have state are left
    alone: entries the checkpoint lacks for them are the planner's partial-state rule.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = getattr(metadata, "planner_data", None) or {}
    added = 0
    for key, smd in metadata.state_dict_metadata.items():
        path = paths.get(key)
        if not path or path[0] != OPTIMIZER_KEY or "state" not in path[1:3]:
            continue
        i = path.index("state", 1)
        if len(path) < i + 3:
            continue
        container: Any = state_dict
        owner: Any = None
        for part in path[: i + 1]:
            try:
                owner, container = container, container[part]
            except (KeyError, IndexError, TypeError):
                container = None
                break
        if not isinstance(container, dict):
            continue
        param = _state_key(owner, container, path[i + 1])
        if param in container and not isinstance(container[param], _Materialised):
            continue
        entry = container.get(param)
        if not isinstance(entry, _Materialised):
            entry = container[param] = _Materialised()
        value = torch.empty(smd.size, dtype=smd.properties.dtype) if isinstance(smd, TensorStorageMetadata) else None
        set_element(entry, path[i + 2:], value)
        added += 1
    return added


def _state_key(owner: Any, container: dict, param: Any) -> Any:
    """The key ``container`` (an optimizer's ``"state"``) uses for the parameter DCP recorded as
    ``param``. DCP records dict keys as ``str(key)``, so an id-keyed optimizer state dict (a plain
    ``optimizer.state_dict()``, whose param_groups list int ids) holds int 0 where the checkpoint
    says "0"; a mismatch would load into new "0" entries and leave the real ones untouched."""
    if param in container or not isinstance(param, str):
        return param
    for k in container:
        if str(k) == param:
            return k
    groups = owner.get("param_groups") if isinstance(owner, dict) else None
    if param.isdigit() and isinstance(groups, list) and any(
            isinstance(p, int) for g in groups if isinstance(g, dict) for p in g.get("params", ())):
        return int(param)
    return param


class _Materialised(dict):
    """Optimizer state of one parameter created by the load (marks it as ours to fill)."""
