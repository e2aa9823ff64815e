"""Load rules, as a DCP ``LoadPlanner``.

* The model must be complete unless ``strict_model=False``; the error names up to 10 missing keys.
* Optimizer entries absent from the checkpoint (frozen parameters, parameters that
  never had a gradient, unrouted MoE experts, a save before the first step) keep
  their current -- zero-initialised -- values, with one warning that counts them.
* The mixed-precision fp32 main-parameter branch: all present -> loaded; none
  present -> dropped from the load (logged); some present -> error naming the missing.
* Non-tensor items are read with ``torch.load(weights_only=True)`` (DCP's default
  planner unpickles them without restriction, which executes code from the checkpoint).
* Before anything is read, every destination tensor is checked, and a caller error
  (:class:`~refckpt.errors.StateMismatchError`, never corruption) is raised inside DCP's plan
  exchange, so every rank raises it when one rank's state is wrong: tensors on the ``meta``
  device; a dtype or shape that differs from the checkpoint's (:class:`~refckpt.errors.ShapeMismatchError`);
  entries whose memory overlaps without being the same view. Entries that are the *same* view
  (tied weights) load only if the checkpoint holds bitwise-equal values for them: its record does
  not say whether the saver tied them (each key is saved on its own), so the values decide. The
  first key (in sorted order) is read into the shared memory, the others into scratch tensors that
  :meth:`RefLoadPlanner.tie_mismatch` compares once the load has read and verified everything.

And the save side, as a DCP ``SavePlanner`` (:class:`RefSavePlanner`): DCP's default save planner
whose check of the coordinator's global plan is refckpt's linear tiling check
(:func:`check_global_save_plan`) instead of DCP's ``_validate_global_plan``, which is quadratic in
ranks for a tensor cut along any dimension but its largest (docs/scale.md, finding 1).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import warnings
from collections import ChainMap
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan
from torch.distributed.tensor import DTensor

from .errors import (
    CheckpointError,
    ConfigError,
    MissingKeysError,
    MissingTrainingStateError,
    ShapeMismatchError,
    StateMismatchError,
)
from .record import _check_tiling, collector_paused
from .safeload import safe_torch_load

__all__ = ["RefLoadPlanner", "RefSavePlanner", "SavePlanCache", "same_save_plan", "check_global_save_plan",
           "MODEL_KEY", "OPTIMIZER_KEY", "EXTRA_STATE_KEY", "MAIN_PARAMS_KEY", "format_keys"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EXTRA_STATE_KEY = "extra_state"
MAIN_PARAMS_KEY = "fp32_main_params"
_SHOW = 10
#: ``LoadPlan.planner_data`` key: whether some rank's state has tied entries (so every rank takes
#: part in comparing them after the load).
_TIES = "refckpt_tied_destinations"


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
        caller_tensors: set[int] | None = None,
    ) -> None:
        # allow_partial_load=True: this planner prunes what may be absent itself and
        # raises for the rest, with messages that name the checkpoint and the fix.
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=True)
        self.checkpoint_path = checkpoint_path
        self.strict_model = strict_model
        self.main_params_key = main_params_key
        self.safe_globals = safe_globals
        self.skipped_optimizer_entries = 0
        #: (key read into the shared memory, key read into a scratch tensor) per tied pair of this rank
        self.ties: list[tuple[str, str]] = []
        #: whether any rank has tied entries (from the global plan)
        self.ties_anywhere = False
        #: ids of the caller's own tensors (a transactional load, :class:`refckpt.storage.SafetensorsReader`):
        #: every other destination (scratch for ties, entries the load creates) belongs to the load
        #: and is filled in pass 1; None: every destination is written as it is read.
        self.caller_tensors = caller_tensors
        #: (the caller's tensor, the scratch the load read its tied values into): copied at :meth:`commit`
        self._tie_sources: list[tuple[Any, torch.Tensor]] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        _refuse_meta_tensors(state_dict, self.checkpoint_path)  # before DCP tries to materialise them
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
        self._check_aliasing(saved)
        plan = local_load_plan(self.state_dict, self.metadata)
        return dataclasses.replace(plan, planner_data={_TIES: bool(self.ties)})

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().create_global_plan(global_plan)
        anywhere = any(self.global_fact(p) for p in plans)
        return [self.central_plan(p, anywhere) for p in plans]

    @staticmethod
    def global_fact(plan: LoadPlan) -> int:
        """The one fact of a rank's local plan that the global plan combines, as 0 or 1: whether that
        rank has tied destinations. A load's plans are otherwise each rank's own (DCP's global load
        plan returns them unchanged), so one all-reduce of this flag can stand for gathering every
        plan (refckpt's load driver, ``refckpt.checkpointer._agreed_load``)."""
        return int(isinstance(plan.planner_data, dict) and bool(plan.planner_data.get(_TIES)))

    @staticmethod
    def central_plan(plan: LoadPlan, anywhere: bool) -> LoadPlan:
        """The plan :meth:`create_global_plan` gives a rank: its own, with the OR of every rank's
        :meth:`global_fact`."""
        return dataclasses.replace(plan, planner_data={_TIES: bool(anywhere)})

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        data = new_plan.planner_data
        self.ties_anywhere = bool(data.get(_TIES)) if isinstance(data, dict) else bool(self.ties)
        return super().finish_plan(new_plan)

    def owns_destination(self, fqn: str) -> bool:
        """Whether the destination of ``fqn`` belongs to this load, not to the caller (a transactional
        load fills those while it verifies; the caller's own only at the commit)."""
        if self.caller_tensors is None:
            return False
        return id(self.state_dict.get(fqn)) not in self.caller_tensors

    def commit(self) -> None:
        """The end of a transactional load, after the reader's commit: tied values read into scratch
        go into the caller's shared memory."""
        for dest, scratch in self._tie_sources:
            local, source = _local(dest), _local(scratch)
            if local is not None and source is not None:
                local.copy_(source)

    def _check_destinations(self, saved) -> None:
        """Every destination must be able to receive the saved value, or the call is wrong (a caller
        error naming the key, raised inside DCP's plan exchange so every rank raises it), never damage:
        a tensor saved where the state holds something else (None, a number); a tensor that overlaps
        itself (``expand``, stride 0), which one value per element cannot fill."""
        wrong, overlapping = [], []
        for key, value in self.state_dict.items():
            smd = saved.get(key)
            if not isinstance(smd, TensorStorageMetadata):
                continue
            if not isinstance(value, torch.Tensor):
                wrong.append(f"{key!r} ({type(value).__name__})")
                continue
            local = _local(value)
            if local is not None and local.numel() > 1 and _self_overlapping(local):
                overlapping.append(repr(key))
        if wrong:
            raise StateMismatchError(
                f"{self.checkpoint_path}: the checkpoint holds tensors where the state to load into holds "
                f"something else: {', '.join(sorted(wrong)[:_SHOW])}{' ...' if len(wrong) > _SHOW else ''}. "
                f"Put a tensor of the saved shape and dtype there (build the state from the model and "
                f"optimizer), or leave those keys out of the state.")
        if overlapping:
            raise StateMismatchError(
                f"{self.checkpoint_path}: {len(overlapping)} tensors of the state to load into overlap themselves "
                f"(an expand()ed or stride-0 view; several elements share one memory location), so they cannot "
                f"hold the saved values: {', '.join(sorted(overlapping)[:_SHOW])}. Load into tensors with memory "
                f"of their own (e.g. .clone() them), then expand after loading.")

    def _check_shapes(self, saved) -> None:
        """Tensors the load would fill must have the saved dtype and shape: otherwise the model does
        not match (a caller error, named here), which is not damage to fall back from. (A dtype that
        differs would otherwise be cast silently: bf16 weights loaded from fp32 lose their low bits.)"""
        self._check_destinations(saved)
        bad = []
        for key, value in self.state_dict.items():
            smd = saved.get(key)
            if isinstance(smd, TensorStorageMetadata) and isinstance(value, torch.Tensor):
                want = (getattr(smd.properties, "dtype", None) or value.dtype, tuple(smd.size))
                got = (value.dtype, tuple(value.shape))
                if got != want:
                    bad.append(f"{key!r}: checkpoint {_describe(*want)}, state {_describe(*got)}")
        if bad:
            raise ShapeMismatchError(
                f"{self.checkpoint_path}: {len(bad)} tensors differ in dtype or shape from the checkpoint: "
                f"{', '.join(sorted(bad)[:_SHOW])}{' ...' if len(bad) > _SHOW else ''}. The model (or "
                f"optimizer) was built differently from the one that saved it; build the same "
                f"architecture, configuration and dtype (convert the dtype after loading), or load into "
                f"a state without those keys."
            )

    def _check_aliasing(self, saved) -> None:
        """Entries the load fills whose memory overlaps (views of one storage; a DTensor's local
        shard) are refused, naming both keys, unless they are the same view (tied weights): then
        the first key is read into the shared memory and the others into scratch tensors, which
        :meth:`tie_mismatch` compares with it after the load. A sweep over each storage's entries
        sorted by offset: linear in the entries for a flat buffer of disjoint views."""
        per_storage: dict[tuple[str, int], list[tuple[int, int, str, torch.Tensor]]] = {}
        for key in sorted(self.state_dict):
            t = _local(self.state_dict[key])
            if t is None or t.numel() == 0 or not isinstance(saved.get(key), TensorStorageMetadata):
                continue
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage: nothing to alias
                continue
            start, end = _byte_span(t)
            per_storage.setdefault((str(t.device), ptr), []).append((start, end, key, t))
        for views in per_storage.values():
            if len(views) < 2:
                continue
            views.sort(key=lambda v: (v[0], v[2]))
            active: list[tuple[int, int, str, torch.Tensor]] = []  # views whose span reaches this one
            for start, end, key, t in views:
                active = [v for v in active if v[1] > start]
                for _, _, other, u in active:
                    if _same_view(t, u):
                        self.ties.append((other, key))
                        self.state_dict[key] = torch.empty_like(self.state_dict[key])
                        if self.caller_tensors is not None and not self.owns_destination(other):
                            # transactional: the first key is read into scratch too (both are compared
                            # before anything of the caller's changes), then copied in at the commit
                            self._tie_sources.append((self.state_dict[other], torch.empty_like(self.state_dict[other])))
                            self.state_dict[other] = self._tie_sources[-1][1]
                        break
                    if _overlap(t, u):
                        raise StateMismatchError(
                            f"{self.checkpoint_path}: {other!r} and {key!r} overlap in memory in the state to "
                            f"load into (views of one storage, not the same view), so loading one would "
                            f"overwrite part of the other. Give each entry its own memory (or make them one "
                            f"tied tensor), or load into a state without one of them."
                        )
                else:
                    active.append((start, end, key, t))

    def tie_mismatch(self) -> str | None:
        """After the load: the tied pairs of this rank whose saved values differ (None when all
        agree). The checkpoint saved such keys as distinct tensors, so the state that shares their
        memory cannot hold both; the shared memory holds the first key's values."""
        bad = [(a, b) for a, b in self.ties
               if not _same_bits(_local(self.state_dict[a]), _local(self.state_dict[b]))]
        if not bad:
            return None
        pairs = ", ".join(f"{a!r} and {b!r}" for a, b in bad[:_SHOW])
        return (f"{self.checkpoint_path}: {pairs} share storage in the state to load into (tied), but the "
                f"checkpoint holds different values for them: the model that saved it did not tie them, and "
                f"one tensor cannot hold both. Build the model untied, as it was saved (or tie it only after "
                f"loading), or load into a state without one of the keys.")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"{self.checkpoint_path} (item {fqn})", self.safe_globals)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:  # pragma: no cover - this planner always flattens
            self.state_dict[fqn] = obj


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata) -> LoadPlan:
    """DCP's ``create_default_local_load_plan`` (strict), without its resharding sweep where the
    sharding is the saved one: a plain tensor saved as one whole chunk, or a DTensor whose local
    shard is exactly one saved chunk (the common resume: same world size and placements), gets its
    one read item straight from the record; every other entry (resharding, 0-size tensors, non-tensor
    items, legacy sharded tensors) takes DCP's own path. The items are DCP's, equal field for field
    and in the same order (``tests/test_format_speed.py`` compares them): this only skips the sweep
    and the per-dimension overlap arithmetic, about 20 us per item."""
    from torch.distributed.checkpoint.planner_helpers import _create_read_items

    saved = metadata.state_dict_metadata
    by_offsets: dict[str, dict[tuple, int]] = {}
    shards: dict[tuple, list] = {}
    requests: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if md is None:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        item = None
        if isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor):
            item = _same_sharding_item(fqn, md, obj, by_offsets, shards)
        if item is not None:
            requests.append(item)
        elif not isinstance(obj, DTensor) or obj.device_mesh.get_coordinate() is not None:
            requests += _create_read_items(fqn, md, obj)
    return LoadPlan(requests)


def _same_sharding_item(fqn: str, md: TensorStorageMetadata, obj: torch.Tensor,
                        by_offsets: dict[str, dict[tuple, int]], shards: dict[tuple, list] | None = None,
                        ) -> ReadItem | None:
    """The one read item of ``obj`` when its local data is exactly one saved chunk, else None.

    ``shards`` caches a DTensor's local chunk by (mesh, placements, global shape), which decide it:
    DTensor's own computation costs ~40 us per tensor, and a model's tensors share a few shapes
    (every block's weight and its two Adam moments)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType

    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        if len(md.chunks) != 1:
            return None
        offsets, sizes = (0,) * obj.dim(), tuple(obj.shape)
    elif isinstance(obj, DTensor):
        if obj.device_mesh.get_coordinate() is None:
            return None
        plain = type(obj._local_tensor) in (torch.Tensor, torch.nn.Parameter)  # else: its own chunk list
        key = (id(obj.device_mesh), tuple(obj.placements), tuple(obj.shape))
        chunks = shards.get(key) if shards is not None and plain else None
        if chunks is None:
            chunks = obj.__create_chunk_list__()  # raises for partial placements, as DCP's planning does
            if shards is not None and plain:
                shards[key] = chunks
        if len(chunks) != 1:
            return None
        offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    else:
        return None
    if 0 in sizes:  # DCP reads nothing for an empty chunk: its own path says so
        return None
    index = by_offsets.get(fqn)
    if index is None:
        index = by_offsets[fqn] = {tuple(c.offsets): i for i, c in enumerate(md.chunks)}
    i = index.get(offsets)
    if i is None or tuple(md.chunks[i].sizes) != sizes:
        return None
    zeros = torch.Size((0,) * len(sizes))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets, 0), dest_offsets=zeros,
                    storage_index=MetadataIndex(fqn, md.chunks[i].offsets, i), storage_offsets=zeros,
                    lengths=torch.Size(sizes))


def local_save_plan(state_dict: dict[str, Any]) -> SavePlan:
    """DCP's ``create_default_local_save_plan``: its write items, equal field for field and in the
    same order (tests/test_format_speed.py compares them), with a DTensor's chunk computed once per
    (mesh, placements, global shape) of the save instead of once per tensor.

    DTensor's own computation (``compute_local_shape_and_global_offset``, and ``to_local()``
    through autograd for the properties) was a quarter of a 2-rank save of 1,168 tensors
    (docs/performance.md); a model's tensors share a few shapes. The first DTensor of each key goes
    through DCP's own ``_create_write_items`` (partial placements raise there, as in DCP), and the
    others reuse its chunk, with their own properties: those of ``to_local()``'s result, whose
    ``requires_grad`` is the DTensor's where autograd records (grad mode on), else False."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    requests: list[WriteItem] = []
    shards: dict[tuple, tuple[torch.Size, torch.Size]] = {}
    grad = torch.is_grad_enabled()
    for fqn, obj in state_dict.items():
        if not isinstance(obj, DTensor):
            requests += _create_write_items(fqn, obj)
            continue
        if obj.device_mesh.get_coordinate() is None:  # not on this rank's part of a sub-mesh
            continue
        local = obj._local_tensor
        plain = type(local) in (torch.Tensor, torch.nn.Parameter)  # else: its own write items
        key = (obj.device_mesh, tuple(obj.placements), tuple(obj.shape))
        got = shards.get(key) if plain else None
        if got is None:
            items = _create_write_items(fqn, obj)
            requests += items
            if plain and len(items) == 1:
                chunk = items[0].tensor_data.chunk  # type: ignore[union-attr]
                shards[key] = (chunk.sizes, chunk.offsets)
            continue
        sizes, offsets = got
        props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=grad and obj.requires_grad,
                                 memory_format=torch.contiguous_format, pin_memory=local.is_pinned())
        requests.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                        properties=props, size=obj.size()),
        ))
    return SavePlan(requests)


def _describe(dtype: Any, shape: tuple) -> str:
    return f"{str(dtype).replace('torch.', '')} {tuple(shape)}"


def _local(value: Any) -> torch.Tensor | None:
    """The tensor whose memory a load writes for ``value``: a DTensor's local shard, a plain
    tensor itself; None for anything else (non-tensor entries, legacy ShardedTensors)."""
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
        return value
    return None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of ``t``'s storage that ``t`` covers (``numel() > 0``)."""
    es, first = t.element_size(), int(t.storage_offset())
    last = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))
    return first * es, (first + last + 1) * es


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage whose byte spans overlap share an element (exact for
    strided views of one element size, such as the column blocks of a fused weight)."""
    if (a.is_contiguous() and b.is_contiguous()) or a.element_size() != b.element_size():
        return True
    (sa, ea), (sb, eb) = _byte_span(a), _byte_span(b)
    es, lo = a.element_size(), min(sa, sb)
    marks = torch.zeros((max(ea, eb) - lo) // es, dtype=torch.bool)
    marks.as_strided(a.shape, a.stride(), (sa - lo) // es).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride(), (sb - lo) // es).any())


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (``expand``, a zero or otherwise colliding stride)."""
    answer = torch._debug_has_internal_overlap(t)
    if answer != 2:  # 0: no, 1: yes, 2: too hard to tell from the strides alone
        return answer == 1
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(int(n), dtype=torch.int64) * int(stride)
    flat = offsets.reshape(-1)
    return int(torch.unique(flat).numel()) != int(flat.numel())


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return a is b
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.dtype != torch.bool:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _refuse_meta_tensors(state_dict: Any, path: str) -> None:
    """A tensor on the ``meta`` device has no storage to load into. DCP would try to allocate one
    on its own (and, without a process group, fail with an unrelated message); refckpt fills the
    caller's tensors in place, so it refuses the state, naming the keys and the fix."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    meta = [k for k, v in flat.items() if isinstance(v, torch.Tensor)
            and (v.is_meta or (isinstance(v, DTensor) and v._local_tensor.is_meta))]
    if meta:
        raise StateMismatchError(
            f"{path}: {len(meta)} tensors of the state to load into are on the meta device, with no memory "
            f"to load into: {format_keys(meta)}. Materialise the model first (e.g. model.to_empty(device=...)), "
            f"then build the state from it (and its optimizer) and load."
        )


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


# -- the save side ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanTag:
    """``SavePlan.planner_data`` of :class:`RefSavePlanner`'s plans (:class:`SavePlanCache`): the key
    paths DCP puts there (a local plan's), and the ids of the kept plans a plan stands for. Travels in
    DCP's plan exchange only; the commit record holds the merged key paths, never this."""

    mappings: Any = None
    local_id: str | None = None
    final_id: str | None = None
    global_id: str | None = None


def _tag(plan: SavePlan) -> PlanTag:
    data = plan.planner_data
    return data if isinstance(data, PlanTag) else PlanTag(mappings=data)


class SavePlanCache:
    """A checkpointer's save plans, kept from one save to the next: the state's structure rarely
    changes between saves, and planning it again costs per item on every rank, and, in a world of
    more than one rank, a pickled gather of every rank's plan to the coordinator and a pickled
    scatter back (a third of a 2-rank save of 1,168 tensors, issue 30).

    Each rank keeps its last local plan (with an id) and the final plan the coordinator sent for it
    (with the coordinator's id). A rank whose new local plan equals its kept one *exactly* -- every
    item's key, chunk, size, dtype and tensor properties, and the key paths (:func:`same_save_plan`;
    DCP's own ``enable_plan_caching`` compares without dtypes) -- sends an empty plan naming the ids
    it holds. The coordinator keeps every rank's recent local plans by id and its last global plan
    and metadata: when every rank's plan is one it knows and the global plan was built from exactly
    those, and every rank holds that global plan's final plan, it sends empty plans back and each rank
    writes with the final plan it kept; otherwise it plans again from the plans it knows (or resends
    the kept global plan to ranks that lack it). A rank whose kept plan the coordinator does not know
    (a checkpointer made anew on the coordinator only) fails that save with a ``CheckpointError``;
    every cache is then cleared, so the next save plans from scratch. Keyed by the process group: a
    new group clears it."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.key: tuple | None = None
        self.local: SavePlan | None = None
        self.local_id: str | None = None
        self.final: SavePlan | None = None
        self.final_id: str | None = None
        #: coordinator: per rank, recent local plans by id (the last two)
        self.known: dict[int, dict[str, SavePlan]] = {}
        self.basis: tuple | None = None
        self.global_plan: list[SavePlan] | None = None
        self.metadata: Metadata | None = None
        self.global_id: str | None = None

    def bind(self, key: tuple) -> None:
        """Use the cache for the process group ``key`` names (cleared when it differs)."""
        if key != self.key:
            self.clear()
            self.key = key


def _token() -> str:
    import secrets

    return secrets.token_hex(8)


def same_save_plan(a: SavePlan, b: SavePlan) -> bool:
    """Whether two local save plans are equal in everything the global plan and the commit record
    are made of: the items (type, key, offset, chunk, size, dtype and the other tensor properties)
    and the key paths."""
    if len(a.items) != len(b.items):
        return False
    for x, y in zip(a.items, b.items):
        if (x.type != y.type or x.index != y.index or x.index.index != y.index.index or x.tensor_data != y.tensor_data
                or getattr(x, "bytes_io_data", None) != getattr(y, "bytes_io_data", None)):
            return False
    return _tag(a).mappings == _tag(b).mappings


class RefSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (flattened state, no plan caching) whose global plan is checked by
    :func:`check_global_save_plan` instead of DCP's ``_validate_global_plan``.

    DCP's check sweeps each tensor's chunks along the tensor's *largest* dimension; when FSDP cut
    another one (a Llama MLP's down projection, 4096 x 11008, cut along dim 0), every chunk spans
    the whole sweep and each is compared with every other: N(N-1)/2 comparisons per such tensor, 84 s
    of the coordinator's save at 4096 ranks (docs/scale.md). :func:`check_global_save_plan` gives
    the same guarantees -- every chunk inside its tensor, no two overlapping, and (more than one
    plan) the chunks covering the tensor -- in time linear in the chunks, and it is the check every
    load makes of the commit record: a save refuses exactly the chunk tables a load would. Everything
    else (dedup of replicated items, DCP's global plan and metadata, the merged key paths) is DCP's
    own, run with the garbage collector paused (:func:`refckpt.record.collector_paused`).
    """

    def __init__(self, cache: SavePlanCache | None = None) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        #: plans kept from the previous save (:class:`SavePlanCache`), or None: plan every save
        self.cache = cache
        self._pending_local: tuple[SavePlan, str] | None = None
        #: whether this save reused the kept plans (the coordinator's global plan; this rank's final plan)
        self.reused_global = False
        self.reused_final = False

    def create_local_plan(self) -> SavePlan:
        # DCP's DefaultSavePlanner.create_local_plan with its own caching off: the items, the key paths
        plan = local_save_plan(self.state_dict)
        plan = dataclasses.replace(plan, planner_data=PlanTag(mappings=self.mappings if self.flatten_state_dict else None))
        self.plan = plan
        cache = self.cache
        if cache is None:
            return plan
        if cache.local is not None and cache.local_id is not None and same_save_plan(plan, cache.local):
            return SavePlan([], planner_data=PlanTag(local_id=cache.local_id, final_id=cache.final_id), usable=False)
        local_id = _token()
        self._pending_local = (plan, local_id)
        return dataclasses.replace(plan, planner_data=dataclasses.replace(_tag(plan), local_id=local_id))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self.cache
        if cache is None:
            global_plan, metadata = self._plan_globally(all_plans)
            self.global_plan, self.metadata = global_plan, metadata
            return global_plan, metadata
        plans, ids = [], []
        for rank, p in enumerate(all_plans):
            local_id = _tag(p).local_id or _token()  # a plan without an id is new
            known = cache.known.setdefault(rank, {})
            if p.usable:
                known[local_id] = p
                while len(known) > 2:  # the rank keeps one plan; one more covers a save that failed after planning
                    del known[next(iter(known))]
            elif local_id not in known:
                cache.clear()
                raise CheckpointError(
                    f"rank {rank} reused a save plan the coordinator does not hold (its checkpointer is older "
                    f"than the coordinator's). Nothing was written; the plans are dropped, so the next save "
                    f"plans from scratch.")
            plans.append(known[local_id])
            ids.append(local_id)
        basis = tuple(ids)
        if basis != cache.basis or cache.global_plan is None or cache.metadata is None:
            global_plan, metadata = self._plan_globally(plans)
            cache.basis, cache.global_plan, cache.metadata, cache.global_id = basis, global_plan, metadata, _token()
        else:
            self.reused_global = True
        gid = cache.global_id
        assert cache.global_plan is not None and cache.metadata is not None
        holds = [not p.usable and _tag(p).final_id == gid for p in all_plans]
        out = [SavePlan([], planner_data=PlanTag(global_id=gid), usable=False) if held
               else dataclasses.replace(g, planner_data=PlanTag(global_id=gid))
               for g, held in zip(cache.global_plan, holds)]
        # The writer empties the metadata it is given once the record is written (SafetensorsWriter.finish):
        # a shallow copy, so that the kept one stays whole for the next save.
        self.global_plan, self.metadata = cache.global_plan, copy.copy(cache.metadata)
        return out, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        cache = self.cache
        if cache is None:
            return super().finish_plan(new_plan)
        gid = _tag(new_plan).global_id
        if new_plan.usable:
            final = dataclasses.replace(new_plan, planner_data=None)
        elif cache.final is not None and gid is not None and gid == cache.final_id:
            final, self.reused_final = cache.final, True
        else:
            cache.clear()
            raise CheckpointError("the coordinator reused a save plan this rank does not hold; the plans are "
                                  "dropped, so the next save plans from scratch. Nothing was written.")
        if self._pending_local is not None:
            cache.local, cache.local_id = self._pending_local
            self._pending_local = None
        cache.final, cache.final_id = final, gid
        return super().finish_plan(final)

    def _plan_globally(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        all_plans = [dataclasses.replace(p, planner_data=_tag(p).mappings) for p in all_plans]
        with collector_paused():  # N plans' worth of small acyclic objects (see collector_paused)
            deduped = self._dedup_save_plans(all_plans)
            global_plan, metadata = create_default_global_save_plan(deduped)
            if self.flatten_state_dict:
                merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
                metadata = dataclasses.replace(metadata, planner_data=merged)
            check_global_save_plan(metadata, whole=len(global_plan) > 1)
        return global_plan, metadata


def _plan_error(source: str, what: str) -> ConfigError:
    return ConfigError(
        f"{source}: {what}. The ranks' save plans do not tile this tensor: they disagree on its shape or "
        f"sharding (a DTensor built with a different mesh, placements or global shape on some rank, or a "
        f"custom planner's chunks). Nothing was written; build the state alike on every rank and save again.")


def check_global_save_plan(metadata: Metadata, whole: bool, source: str = "the global save plan") -> None:
    """Refuse (:class:`~refckpt.errors.ConfigError`) a global save plan whose chunks of a tensor reach
    outside it, overlap, or (``whole``: more than one rank's plan) leave part of it uncovered.

    ``refckpt.record._check_tiling`` on every tensor of ``metadata``: linear in the number of chunks
    (DCP's ``_validate_global_plan`` is quadratic in it for some tensors), and the same check a load
    makes of the record this plan becomes. Stricter than DCP's in two cases no sharding produces,
    both of which a load refuses: two chunks of a scalar, and chunks that cut a tensor into more than
    ``16 x chunks + 64`` grid cells."""
    for fqn, smd in metadata.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks]
            _check_tiling(fqn, tuple(smd.size), boxes, whole, source, bad=_plan_error)
