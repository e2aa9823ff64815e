"""Converting checkpoints: out of refckpt's layout into one safetensors file, and into it.

Directions, chosen from the input (:func:`detect_input`):

* a refckpt step directory (or a root: the step resume picks) -> one consolidated safetensors
  file. Shards are assembled by DCP's own load machinery in this process (no process group),
  through :func:`refckpt.tools.read_state`, so checksums are verified on the way. Model keys
  are the model's own (``0.weight``); ``with_optimizer`` adds optimizer tensors (and the
  fp32 main-parameter branch, if saved) under their flattened DCP keys
  (``optimizer.state.0.weight.exp_avg``), and the param-group hyperparameters as JSON in the
  file's metadata.
* a plain DCP checkpoint directory (``.metadata`` + ``*.distcp``) -> the same safetensors file
  when ``out`` ends with ``.safetensors``, otherwise into refckpt's layout.
* a ``torch.save`` file (read with ``weights_only=True`` only) -> refckpt's layout. A plain
  ``optimizer.state_dict()`` in it keys ``state`` by parameter index and lists int ids in its
  ``param_groups``; the resume recipe (:func:`refckpt.get_training_state`, i.e. DCP's
  ``get_state_dict``) keys them by parameter name, so convert re-keys them
  (:func:`optimizer_by_name`): the ids of the concatenated param groups are paired, in order, with
  the model's parameters (the model state dict's entries less well-known buffers such as
  BatchNorm's ``running_mean``; tied entries count once), as ``Optimizer.load_state_dict`` pairs
  them with a live optimizer's. Where that pairing cannot be trusted -- several param groups,
  counts that differ, a state tensor whose shape is not its parameter's -- convert refuses and
  asks for ``param_names`` (``--param-names FILE``: one name per line in the optimizer's
  parameter order). An optimizer state dict already keyed by name is written unchanged.

"Into refckpt's layout" means ``out`` is a checkpoint root and step ``step`` is written by
:meth:`DistributedCheckpointer.save` in this process: the result has the commit record,
checksums and the pointer, exactly as training would have written it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zipfile
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from ..checkpointer import EXTRA_STATE_PER_RANK, DistributedCheckpointer
from ..durable import DEFAULT_IO
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    InvalidCheckpointPathError,
)
from ..layout import EXTRA_STATE_DIR, check_step_dir, find_latest_checkpoint, step_dir_name
from ..planner import EXTRA_STATE_KEY, MAIN_PARAMS_KEY, MODEL_KEY, OPTIMIZER_KEY
from ..safeload import open_regular, safe_torch_load
from .readers import EXTRA_NONE, KIND_ROOT, extra_state_layout, jsonable, quiet_single_process, read_state, resolve, saved_tops

__all__ = ["KIND_REFCKPT", "KIND_DCP", "KIND_TORCH_SAVE", "SAFETENSORS_SUFFIX", "ConvertResult", "detect_input", "convert",
           "optimizer_by_name", "read_param_names"]

log = logging.getLogger(__name__)

KIND_REFCKPT = "refckpt"
KIND_DCP = "dcp"
KIND_TORCH_SAVE = "torch.save"
SAFETENSORS_SUFFIX = ".safetensors"
#: top-level keys of a ``torch.save`` dict that hold the model / the optimizer, in preference order.
_MODEL_KEYS = (MODEL_KEY, "state_dict", "model_state_dict")
_OPTIMIZER_KEYS = (OPTIMIZER_KEY, "optimizer_state_dict", "optim")
#: model state-dict entries that are buffers whatever the model (BatchNorm's running statistics):
#: never paired with an optimizer id.
_BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})
#: per-parameter state entries whose shape is not the parameter's (Adafactor's factored second
#: moment): entry -> the dimension, counted from the end, that is 1.
_FACTORED_ENTRIES = {"row_var": -1, "col_var": -2}
_NAMES_HOWTO = ('one parameter name per line, in the optimizer\'s parameter order; write it with '
                '[n for g in opt.param_groups for p in g["params"] for n, q in model.named_parameters() if q is p]')


@dataclasses.dataclass
class ConvertResult:
    source: str
    source_kind: str
    #: the safetensors file, or the step directory written.
    out: str
    out_kind: str
    tensors: int
    bytes: int
    notes: list[str] = dataclasses.field(default_factory=list)


def _is_torch_save(path: str) -> bool:
    """torch.save writes a zip archive (since 1.6) or, legacy, a pickle stream (protocol 2 marker)."""
    with open_regular(path) as f:  # a FIFO or device is refused, never blocked on
        if zipfile.is_zipfile(f):
            return True
        f.seek(0)
        return f.read(2) in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def detect_input(path: str | os.PathLike) -> tuple[str, str]:
    """(kind, path): a refckpt step directory, a plain DCP checkpoint directory, or a torch.save file.

    A root resolves to the step resume would pick.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        if _is_torch_save(path):
            return KIND_TORCH_SAVE, path
        raise InvalidCheckpointPathError(
            f"{path}: not a torch.save file (neither a zip archive nor a pickle stream); convert reads "
            f"torch.save files, plain DCP checkpoint directories and refckpt step directories."
        )
    kind, path = resolve(path)
    if kind == KIND_ROOT:
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise IncompleteCheckpointError(
                f"{path}: holds no complete checkpoint to convert; `refckpt ls {path}` says why each step is not.")
        path = latest
    st = check_step_dir(path)
    if not st.complete:
        raise IncompleteCheckpointError(f"{path}: not a complete checkpoint ({st.reason}); nothing to convert.")
    return (KIND_REFCKPT if st.manifest is not None else KIND_DCP), path


def _flatten(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def _fsync_path(path: str) -> None:
    with open(path, "rb") as f:
        DEFAULT_IO.fsync(f)


def _write_safetensors(tensors: dict[str, torch.Tensor], out: str, metadata: dict[str, str]) -> None:
    """safetensors' own writer into a tmp file beside ``out``, then fsync -> rename -> fsync dir."""
    from safetensors.torch import save_file

    parent = os.path.dirname(out) or "."
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp.{os.getpid()}")
    try:
        save_file(tensors, tmp, metadata=metadata)
        _fsync_path(tmp)
        DEFAULT_IO.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    DEFAULT_IO.fsync_dir(parent)


def _to_safetensors(src: str, kind: str, out: str, with_optimizer: bool, force: bool) -> ConvertResult:
    if os.path.isdir(out):
        raise InvalidCheckpointPathError(
            f"{out}: is a directory; name the safetensors file to write (e.g. {out.rstrip(os.sep)}/model.safetensors).")
    if os.path.exists(out) and not force:
        raise ConfigError(f"{out}: exists; pass --force to replace it, or choose another file name.")
    parent = os.path.dirname(out) or "."
    if not os.path.isdir(parent):
        raise CheckpointNotFoundError(f"{parent}: no such directory for {os.path.basename(out)}; create it first.")
    st = check_step_dir(src)
    tops = saved_tops(st.metadata)
    if MODEL_KEY not in tops:
        raise InvalidCheckpointPathError(
            f"{src}: holds no '{MODEL_KEY}' entry (top-level keys: {', '.join(tops)}); convert writes the model's tensors.")
    wanted = [MODEL_KEY] + ([OPTIMIZER_KEY, MAIN_PARAMS_KEY] if with_optimizer else [])
    state = read_state(src, wanted, with_extra=False)
    tensors: dict[str, torch.Tensor] = {}
    skipped = []
    for key, value in _flatten(state).items():
        if not isinstance(value, torch.Tensor):
            skipped.append(key)
            continue
        name = key[len(MODEL_KEY) + 1:] if key.startswith(MODEL_KEY + ".") else key
        tensors[name] = value.detach().contiguous()
    metadata = {"format": "pt", "refckpt.source": src, "refckpt.source_kind": kind}
    step = st.step if st.step is not None else (st.manifest.global_step if st.manifest is not None else None)
    if step is not None:
        metadata["refckpt.global_step"] = str(step)
    notes = []
    if with_optimizer and OPTIMIZER_KEY in state:
        groups = state[OPTIMIZER_KEY].get("param_groups") if isinstance(state[OPTIMIZER_KEY], dict) else None
        if groups:
            metadata["optimizer.param_groups"] = json.dumps(jsonable(groups))
            notes.append("optimizer param_groups stored as JSON in the file's metadata ('optimizer.param_groups')")
    elif with_optimizer:
        notes.append(f"{src} holds no optimizer state; wrote the model only")
    non_tensor = [k for k in skipped if not k.startswith(f"{OPTIMIZER_KEY}.param_groups.")]
    if non_tensor:
        notes.append(f"skipped {len(non_tensor)} non-tensor item(s) safetensors cannot hold: {', '.join(non_tensor[:5])}")
    _write_safetensors(tensors, out, metadata)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info("wrote %d tensors (%d bytes) from %s to %s", len(tensors), nbytes, src, out)
    return ConvertResult(src, kind, out, "safetensors", len(tensors), nbytes, notes)


def read_param_names(path: str | os.PathLike) -> list[str]:
    """The parameter names of ``--param-names FILE``: one per line; blank lines and lines starting
    with ``#`` are skipped, surrounding white space is dropped."""
    path = os.fspath(path)
    try:
        with open_regular(path) as f:
            text = f.read().decode("utf-8")
    except (OSError, CheckpointError, UnicodeDecodeError) as e:
        raise ConfigError(f"--param-names {path}: cannot be read ({e}); it must be a UTF-8 text file holding "
                          f"{_NAMES_HOWTO}.") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _view_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same view of one storage (tied weights, as torch.save keeps them)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _parameter_candidates(model_sd: dict[str, Any]) -> list[str]:
    """The model state dict's entries that can be parameters, in order: the order of
    ``model.named_parameters()`` when every remaining entry is a parameter. Left out: non-tensors,
    BatchNorm's buffers by name, integer tensors (no optimizer steps them), and an entry that is
    the same view as an earlier one (a tied weight: ``named_parameters`` yields it once, first name)."""
    names: list[str] = []
    seen: set[tuple] = set()
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor) or str(key).rsplit(".", 1)[-1] in _BUFFER_NAMES:
            continue
        if not (value.is_floating_point() or value.is_complex()):
            continue
        if value.numel():  # empty tensors may all report data_ptr 0
            view = _view_key(value)
            if view in seen:
                continue
            seen.add(view)
        names.append(str(key))
    return names


def _expected_shape(entry: str, param_shape: torch.Size) -> tuple[int, ...]:
    shape = list(param_shape)
    dim = _FACTORED_ENTRIES.get(entry)
    if dim is not None and len(shape) >= -dim:
        shape[dim] = 1
    return tuple(shape)


def optimizer_by_name(
    osd: Any,
    model_sd: dict[str, Any],
    *,
    param_names: list[str] | None = None,
    source: str = "",
    names_source: str = "",
) -> tuple[Any, list[str]]:
    """``osd`` (a torch.optim state dict) keyed by parameter name, as DCP's ``get_state_dict``
    keys it: ``state`` by name, each group's ``params`` a list of names, every other
    hyperparameter and every state entry kept as it is (the same objects). Returns it with notes.

    An index-keyed ``osd`` (a plain ``optimizer.state_dict()``) is re-keyed: position ``i`` of the
    concatenated groups' ``params`` is ``param_names[i]`` or, without names, the ``i``-th entry of
    ``model_sd`` that can be a parameter (see :func:`_parameter_candidates`), which is how
    ``Optimizer.load_state_dict`` pairs saved ids with a live optimizer built from
    ``model.parameters()``. Without names, several param groups or counts that differ are refused
    (:class:`ConfigError`); with or without, so is a per-parameter state tensor whose shape is not
    its parameter's. A name-keyed ``osd``, or anything that is not an optimizer state dict, is
    returned unchanged (``param_names`` are then refused: there is nothing to map).
    """
    src = source or "the optimizer state dict"
    names_src = f"--param-names {names_source}" if names_source else "param_names"
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    state = osd.get("state") if isinstance(osd, dict) else None
    shaped = (isinstance(groups, list) and isinstance(state, dict)
              and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups))
    if not shaped:
        if param_names is not None:
            raise ConfigError(f"{names_src} applies to an optimizer state dict keyed by parameter index; {src} holds "
                              f"no torch.optim state dict ('state' and 'param_groups'). Drop the option.")
        return osd, []
    assert isinstance(groups, list) and isinstance(state, dict)
    ids = [p for g in groups for p in g["params"]]
    keys = list(state)
    if all(isinstance(k, str) for k in ids + keys):
        if param_names is not None:
            raise ConfigError(f"{names_src}: the optimizer state in {src} is already keyed by parameter name "
                              f"(e.g. {next(iter(ids + keys), '?')!r}); there is nothing to map. Drop the option.")
        return osd, []
    if not all(_is_int(k) for k in ids + keys):
        odd = next(k for k in ids + keys if not _is_int(k))
        raise InvalidCheckpointPathError(
            f"{src}: the optimizer state dict mixes parameter ids and names ({odd!r}); save one produced by "
            f"optimizer.state_dict() (ids) or by get_state_dict(model, optimizer) (names), and convert that.")
    listed = set(ids)
    if len(listed) != len(ids):
        dup = next(i for i, n in Counter(ids).items() if n > 1)
        raise InvalidCheckpointPathError(
            f"{src}: parameter id {dup} appears more than once in the optimizer's param_groups; torch.optim never "
            f"writes that. Save optimizer.state_dict() of the optimizer itself and convert that.")
    unlisted = [k for k in keys if k not in listed]
    if unlisted:
        raise InvalidCheckpointPathError(
            f"{src}: the optimizer holds state for parameter id(s) {unlisted[:5]} that no param group lists; "
            f"save optimizer.state_dict() of the optimizer itself and convert that.")
    notes: list[str] = []
    if param_names is not None:
        dups = sorted(n for n, c in Counter(param_names).items() if c > 1)
        unknown = [n for n in param_names if not isinstance(model_sd.get(n), torch.Tensor)]
        problem = (f"lists {len(param_names)} name(s) but the optimizer in {src} has {len(ids)} parameter(s)"
                   if len(param_names) != len(ids)
                   else f"names {unknown[:5]}, which are not tensors of the model state dict in {src}" if unknown
                   else f"lists {dups[:5]} more than once" if dups else "")
        if problem:
            raise ConfigError(f"{names_src}: {problem}. The file must hold {_NAMES_HOWTO}.")
        names, how = list(param_names), f"by {names_src}"
    else:
        fix = f"pass --param-names FILE (param_names=[...] to convert()): {_NAMES_HOWTO}"
        if len(groups) > 1:
            raise ConfigError(
                f"{src}: the optimizer has {len(groups)} param groups; the order of their parameter ids need not "
                f"follow the model's, so the ids cannot be named safely. To convert it, {fix}.")
        names = _parameter_candidates(model_sd)
        if len(names) != len(ids):
            raise ConfigError(
                f"{src}: the optimizer has {len(ids)} parameter(s) but the model state dict has {len(names)} entries "
                f"that can be parameters (buffers cannot be told from parameters by name, and an optimizer may "
                f"hold a subset of the parameters), so the ids cannot be named safely. To convert it, {fix}.")
        how = "in the model's parameter order"
    by_id = dict(zip(ids, names))
    bad = []
    for pid, entries in state.items():
        shape = model_sd[by_id[pid]].shape
        for entry, value in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                want = _expected_shape(str(entry), shape)
                if tuple(value.shape) != want:
                    bad.append(f"id {pid} -> {by_id[pid]!r}: {entry} {list(value.shape)}, parameter {list(want)}")
    if bad:
        fix = ("check that the file lists the names in the optimizer's parameter order" if param_names is not None
               else f"the optimizer's parameters are not in the model's order; pass --param-names FILE "
                    f"(param_names=[...] to convert()): {_NAMES_HOWTO}")
        raise ConfigError(f"{src}: paired {how}, {len(bad)} optimizer state tensor(s) do not have the shape of their "
                          f"parameter: {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. To convert it, {fix}.")
    out = {k: v for k, v in osd.items() if k not in ("state", "param_groups")}
    out["state"] = {by_id[pid]: entries for pid, entries in state.items()}
    out["param_groups"] = [{**g, "params": [by_id[pid] for pid in g["params"]]} for g in groups]
    notes.append(f"optimizer state keyed by parameter name ({len(ids)} parameters, paired {how})")
    stateless = [by_id[pid] for pid in ids if pid not in state]
    if stateless:
        notes.append(f"{len(stateless)} parameter(s) have no optimizer state (never had a gradient): "
                     f"{', '.join(stateless[:5])}{' ...' if len(stateless) > 5 else ''}")
    return out, notes


def _state_from_torch_save(path: str, param_names: list[str] | None = None,
                           names_source: str = "") -> tuple[dict[str, Any], list[str]]:
    with open_regular(path) as f:
        obj = safe_torch_load(f, path)
    if not isinstance(obj, dict):
        raise InvalidCheckpointPathError(
            f"{path}: holds a {type(obj).__name__}; convert expects a dict: a model state dict, or "
            f"{{'model': ..., 'optimizer': ..., 'extra_state': ...}}.")
    notes: list[str] = []
    model_key = next((k for k in _MODEL_KEYS if isinstance(obj.get(k), dict)), None)
    if model_key is None:
        if param_names is not None:
            raise ConfigError(f"--param-names applies to a torch.save file with an optimizer; {path} holds no "
                              f"'model' and 'optimizer' entries. Drop the option.")
        if not obj or not all(isinstance(v, torch.Tensor) for v in _flatten(obj).values()):
            raise InvalidCheckpointPathError(
                f"{path}: neither a state dict of tensors nor a dict with one of {list(_MODEL_KEYS)}; "
                f"save {{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}} and convert that.")
        return {MODEL_KEY: obj, EXTRA_STATE_KEY: {}}, ["the file is a plain state dict: saved as the model"]
    state: dict[str, Any] = {MODEL_KEY: obj[model_key]}
    opt_key = next((k for k in _OPTIMIZER_KEYS if isinstance(obj.get(k), dict)), None)
    if opt_key is not None:
        state[OPTIMIZER_KEY], renamed = optimizer_by_name(
            obj[opt_key], obj[model_key], param_names=param_names, source=f"{path} ({opt_key!r})",
            names_source=names_source)
        notes += renamed
    elif param_names is not None:
        raise ConfigError(f"--param-names applies to a torch.save file with an optimizer; {path} holds none "
                          f"(none of {list(_OPTIMIZER_KEYS)}). Drop the option.")
    extra = dict(obj[EXTRA_STATE_KEY]) if isinstance(obj.get(EXTRA_STATE_KEY), dict) else {}
    rest = [k for k in obj if k not in (model_key, opt_key, EXTRA_STATE_KEY)]
    for k in rest:
        extra[str(k)] = obj[k]
    if rest:
        notes.append(f"top-level entries {', '.join(map(str, rest))} saved into extra_state")
    state[EXTRA_STATE_KEY] = extra
    return state, notes


def _state_from_dcp(src: str, drop_extra_state: bool) -> tuple[dict[str, Any], list[str]]:
    st = check_step_dir(src)
    layout = extra_state_layout(st)
    notes: list[str] = []
    with_extra = layout not in (None, EXTRA_NONE) and not drop_extra_state
    if with_extra and layout == EXTRA_STATE_PER_RANK:
        files = os.listdir(os.path.join(src, EXTRA_STATE_DIR))
        if len(files) > 1:
            raise ConfigError(
                f"{src}: {len(files)} per-rank extra-state files; a conversion in one process writes one "
                f"rank's. Pass --drop-extra-state to convert model and optimizer only (the new "
                f"checkpoint's extra_state then holds just global_step).")
    state = read_state(src, with_extra=with_extra)
    if MODEL_KEY not in state:  # a DCP save of a bare state dict: everything is the model
        extra = state.pop(EXTRA_STATE_KEY, None)
        state = {MODEL_KEY: state}
        if extra is not None:
            state[EXTRA_STATE_KEY] = extra
        notes.append("no 'model' entry: every saved item became the model")
    if drop_extra_state and layout not in (None, EXTRA_NONE):
        notes.append("extra state dropped (--drop-extra-state)")
    state.setdefault(EXTRA_STATE_KEY, {})
    return state, notes


def _to_refckpt(src: str, kind: str, out: str, step: int, force: bool, drop_extra_state: bool,
                param_names: list[str] | None = None, names_source: str = "") -> ConvertResult:
    step_dir_name(step)  # validates the step number before any reading
    if os.path.exists(out) and not os.path.isdir(out):
        raise InvalidCheckpointPathError(
            f"{out}: exists and is not a directory; name a checkpoint root (a directory) to write into.")
    if kind == KIND_TORCH_SAVE:
        if drop_extra_state:
            raise ConfigError("--drop-extra-state applies to DCP inputs with several per-rank extra-state files.")
        state, notes = _state_from_torch_save(src, param_names, names_source)
    else:
        state, notes = _state_from_dcp(src, drop_extra_state)
    state[EXTRA_STATE_KEY].setdefault("global_step", step)
    ck = DistributedCheckpointer(extra_state_per_rank=True, overwrite=force)
    with quiet_single_process():
        ck.save(out, state, global_step=step)
    step_dir = os.path.join(os.path.abspath(out), step_dir_name(step))
    tensors = [v for v in _flatten({k: v for k, v in state.items() if k != EXTRA_STATE_KEY}).values()
               if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return ConvertResult(src, kind, step_dir, KIND_REFCKPT, len(tensors), nbytes, notes)


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    with_optimizer: bool = False,
    force: bool = False,
    drop_extra_state: bool = False,
    param_names: str | os.PathLike | Iterable[str] | None = None,
) -> ConvertResult:
    """Convert ``src`` (kind detected) into ``out``; see the module docstring for the directions.

    ``step``: the step written into refckpt's layout (default 0); meaningless for safetensors output.
    ``force``: replace an existing safetensors file, or overwrite a complete step ``step``
    (``DistributedCheckpointer(overwrite=True)``: the old step stays resumable until the new one
    is committed).
    ``param_names``: a ``torch.save`` file whose optimizer state is keyed by parameter index: the
    parameter names in the optimizer's parameter order (the concatenated param groups'), as a file
    of one name per line (``--param-names FILE``) or a list. Needed where the ids cannot be paired
    with the model's parameters safely (several param groups, an optimizer over a subset of the
    parameters, buffers other than BatchNorm's, parameters out of the model's order); the optimizer
    state is then written keyed by these names, as ``get_training_state`` asks for it on resume.
    """
    kind, src = detect_input(src)
    out = os.path.abspath(os.fspath(out))
    to_safetensors = kind == KIND_REFCKPT or (kind == KIND_DCP and out.endswith(SAFETENSORS_SUFFIX))
    names: list[str] | None = None
    names_source = ""
    if param_names is not None:
        if kind != KIND_TORCH_SAVE:
            raise ConfigError(f"--param-names applies to torch.save input (an optimizer state keyed by parameter "
                              f"index); {src} is a {kind} checkpoint. Drop the option.")
        if isinstance(param_names, (str, os.PathLike)):
            names_source = os.fspath(param_names)
            names = read_param_names(names_source)
        else:
            names = list(param_names)
            if not all(isinstance(n, str) for n in names):
                raise ConfigError(f"param_names: expected parameter names (str), got {names[:5]!r}; pass the names "
                                  f"in the optimizer's parameter order, or a file of them.")
    if to_safetensors:
        if drop_extra_state or step is not None:
            flag = "--drop-extra-state" if drop_extra_state else "--step"
            raise ConfigError(f"{flag} applies to conversions into refckpt's layout; {src} converts into one "
                              f"safetensors file ({out}), which keeps the step it was saved at.")
        return _to_safetensors(src, kind, out, with_optimizer, force)
    if with_optimizer:
        raise ConfigError(
            f"--with-optimizer applies to safetensors output; converting {src} into refckpt's layout at "
            f"{out} keeps the optimizer state anyway.")
    if out.endswith(SAFETENSORS_SUFFIX):
        raise ConfigError(
            f"{src}: a torch.save file converts into refckpt's layout only; convert it into a root "
            f"first (refckpt convert {src} ROOT), then that step into {os.path.basename(out)}.")
    return _to_refckpt(src, kind, out, 0 if step is None else step, force, drop_extra_state, names, names_source)

