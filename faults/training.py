"""A small, fully deterministic training job the resilience suite checkpoints and resumes.

Everything the suite's oracle needs is recomputed here, independently of any checkpointer:
the state at global step ``s`` is a pure function of (:class:`RunConfig`, world size, ``s``),
so :meth:`TrainRun.digest` of a resumed run is compared with the digest of a run trained
from scratch to the same step -- "resume equivalence" -- never with what a checkpointer said.

What varies (drawn by :mod:`faults.strategies`):

* the model: widths, depth, a frozen parameter, weights tied between the input and output
  projections, a module outside the forward (its parameters never get a gradient, so the
  optimizer never creates state for them: partial optimizer state), a branch that joins the
  forward at step 2 (a checkpoint of step 1 lacks its optimizer state, one of step 2 has it: what a
  fallback from step 2 to step 1 must not mix), dtype fp32/bf16/fp16;
* the optimizers: one to three of AdamW, Adam+amsgrad, SGD momentum, RMSprop and Adagrad at
  once (parameters dealt round robin), optionally over fp32 main parameters of a
  low-precision model (the ``fp32_main_params`` branch of the state);
* the sharding: replicated (gradients all-reduced, data parallel) or FSDP2 ``fully_shard``;
* extra state: per rank (a rank-seeded RNG and a data position differ between ranks) or
  rank-invariant (what an embedded layout can hold).

Nothing here imports refckpt: the suite judges any checkpointer through the harness
interface only. This module does not import torch.distributed at import time; the rank
functions (``r_*``) run inside :class:`faults.world.World` ranks and keep their runs in a
per-process registry so that one reused world serves a whole state-machine example.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .contract import step_dir_name

__all__ = ["ModelSpec", "OptimSpec", "RunConfig", "TrainRun", "OPTIMIZERS", "DTYPES", "MAIN_PARAMS_KEY", "LATE_FROM",
           "load_factory", "tensor_bytes", "NOT_AN_EXCEPTION", "describe_error"]

OPTIMIZERS = ("adamw", "adam_amsgrad", "sgd_momentum", "rmsprop", "adagrad")
DTYPES = ("float32", "bfloat16", "float16")
#: top-level key of the fp32 main-parameter branch (the mixed-precision convention of docs/design.md, "Load").
MAIN_PARAMS_KEY = "fp32_main_params"
#: The step from which :attr:`ModelSpec.late`'s branch is in the forward: a checkpoint of an earlier
#: step holds no optimizer state for its parameters, one of this step or later does.
LATE_FROM = 2


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    dim: int = 6
    hidden: int = 8
    depth: int = 1
    frozen: bool = False   # the first body layer's bias takes no gradient (not in any optimizer)
    tied: bool = False     # head.weight is embed.weight (one Parameter, two state-dict keys)
    unused: bool = False   # a module outside the forward: never a gradient, never optimizer state
    late: bool = False     # a branch that joins the forward at step 2: no optimizer state before it
    dtype: str = "float32"
    strided: bool = False  # the body layers' weights are transposed views (non-contiguous; so are their moments)
    empty: bool = False    # a parameter with no elements, outside the forward (its moments are empty too)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    kinds: tuple[str, ...] = ("adamw",)
    main_fp32: bool = False  # the model trains in ``dtype``; optimizers step fp32 main copies


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelSpec = ModelSpec()
    optim: OptimSpec = OptimSpec()
    sharding: str = "replicated"  # or "fsdp2"
    extra_per_rank: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sharding not in ("replicated", "fsdp2"):
            raise ValueError(f"sharding={self.sharding!r}: choose 'replicated' or 'fsdp2'")
        for k in self.optim.kinds:
            if k not in OPTIMIZERS:
                raise ValueError(f"unknown optimizer kind {k!r}; choose from {OPTIMIZERS}")
        if self.model.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.model.dtype!r}; choose from {DTYPES}")


def load_factory(spec: str):
    """``package.module:callable`` -> the callable (the ``--checkpointer`` format). Under
    ``FAULTS_REPRO_RECORD`` (set by ``python -m faults repro`` for its test run), the factory is
    wrapped so that each checkpointer it makes records its contract calls (:mod:`faults.repro`)."""
    mod, sep, name = spec.partition(":")
    if not sep or not name:
        raise ValueError(f"checkpointer {spec!r}: expected 'package.module:factory'")
    factory = getattr(importlib.import_module(mod), name)
    if os.environ.get("FAULTS_REPRO_RECORD"):  # `python -m faults repro`: every checkpointer records its calls
        from .repro import recording_factory

        factory = recording_factory(factory, spec)
    return factory


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Net(torch.nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, h = spec.dim, spec.hidden
        self.embed = torch.nn.Linear(d, d, bias=False)
        self.body = torch.nn.ModuleList(torch.nn.Linear(d if i == 0 else h, h) for i in range(spec.depth))
        self.out = torch.nn.Linear(h, d)
        self.head = torch.nn.Linear(d, d, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight
        if spec.unused:
            self.unused = torch.nn.Linear(d, 2)
        if spec.late:
            self.late = torch.nn.Linear(d, d)
        if spec.frozen:
            self.body[0].bias.requires_grad_(False)
        if spec.strided:  # the same values, in transposed storage: a load must not assume contiguous memory
            for layer in self.body:
                assert isinstance(layer, torch.nn.Linear)
                layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t())
        if spec.empty:
            self.empty = torch.nn.Parameter(torch.zeros(0, d))

    def forward(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        x = self.embed(x)
        if step >= LATE_FROM and hasattr(self, "late"):
            x = x + self.late(x)
        for layer in self.body:
            x = torch.tanh(layer(x))
        return self.head(self.out(x))


def _make_optimizer(kind: str, params: list) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2)
    return torch.optim.Adagrad(params, lr=1e-2)


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


class TrainRun:
    """One rank's training job at ``self.step``; ``train_to`` is deterministic in the config."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.dist, self.rank, self.world = _dist()
        torch.manual_seed(cfg.seed)
        dtype = getattr(torch, cfg.model.dtype)
        net = Net(cfg.model)
        self.main = net if cfg.optim.main_fp32 else None  # fp32 main copy the optimizers step
        self.model = copy.deepcopy(net).to(dtype) if cfg.optim.main_fp32 else net.to(dtype)
        if cfg.sharding == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in self.model.body:
                fully_shard(layer)
            fully_shard(self.model)
        stepped = self.main if self.main is not None else self.model
        params, seen = [], set()
        for _, p in stepped.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        kinds = cfg.optim.kinds
        self.opts = [_make_optimizer(k, params[i::len(kinds)]) for i, k in enumerate(kinds) if params[i::len(kinds)]]
        self._names = {id(p): n for n, p in stepped.named_parameters()}
        self._prime(lambda name: not name.startswith(("unused.", "late.")))
        noise_seed = cfg.seed * 1_000_003 + (self.rank + 1 if cfg.extra_per_rank else 0)
        self.gen = torch.Generator().manual_seed(noise_seed)
        self.step = 0

    def _prime(self, which) -> None:
        """Materialise optimizer state for the parameters ``which(name)`` selects, neutrally: a
        step with zero gradients and lr 0, then every new ``step`` counter reset to 0, so that
        training from it is bitwise the same as from a fresh optimizer. (DCP's
        ``get_state_dict`` primes an empty optimizer too, but leaves ``step`` at 1: a checkpoint
        taken before the first step would then resume one bias-correction step off.)"""
        for o in self.opts:
            new, lrs = [], []
            for g in o.param_groups:
                for p in g["params"]:
                    if which(self._names[id(p)]) and not o.state.get(p):
                        p.grad = torch.zeros_like(p)
                        new.append(p)
                lrs.append(g["lr"])
                g["lr"] = 0.0
            if new:
                o.step()
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr
            for p in new:
                p.grad = None
                st = o.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"].zero_()
                elif "step" in st:
                    st["step"] = 0

    # -- training --------------------------------------------------------------------------

    def _batch(self, step: int) -> torch.Tensor:
        data_rank = self.rank if self.cfg.extra_per_rank else 0
        g = torch.Generator().manual_seed(self.cfg.seed * 7919 + step * 131 + data_rank)
        x = torch.randn(3, self.cfg.model.dim, generator=g)
        return (x + 0.01 * torch.randn(x.shape, generator=self.gen)).to(getattr(torch, self.cfg.model.dtype))

    def train_to(self, step: int) -> None:
        while self.step < step:
            self.step += 1
            loss = self.model(self._batch(self.step), self.step).float().pow(2).mean()
            for o in self.opts:
                o.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg.sharding == "replicated" and self.dist is not None and self.world > 1:
                average_gradients(self.dist, self.model.parameters(), self.world)
            if self.main is not None:
                for (_, lo), (_, hi) in zip(self.model.named_parameters(), self.main.named_parameters()):
                    hi.grad = None if lo.grad is None else lo.grad.float()
            for o in self.opts:
                o.step()
            if self.main is not None:
                with torch.no_grad():
                    for lo, hi in zip(self.model.parameters(), self.main.parameters()):
                        lo.copy_(hi)

    # -- the state a checkpointer sees -------------------------------------------------------

    def extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"global_step": self.step, "rng": self.gen.get_state()}
        if self.cfg.extra_per_rank:
            out["rank"] = self.rank
            out["data_position"] = self.step * self.world + self.rank
        return out

    def state(self, *, unprimed: bool = False, target: bool = False) -> dict[str, Any]:
        """The harness-contract state: DCP ``get_state_dict`` output as is.

        ``target``: the state to load into. It also holds state for parameters that never had
        a gradient (as DCP's priming gives every parameter), which the saved run lacks: partial
        optimizer state the checkpointer must tolerate. ``unprimed``: the optimizer entry is a
        state dict before the first step (no per-parameter state); a correct checkpointer must
        still restore every moment.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if target:
            self._prime(lambda name: True)
        stepped = self.main if self.main is not None else self.model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            msd, osd = get_state_dict(stepped, self.opts)
        if unprimed:
            osd = {"state": {}, "param_groups": osd["param_groups"]}
        state = {"model": msd, "optimizer": osd, "extra_state": self.extra()}
        if self.main is not None:
            state[MAIN_PARAMS_KEY] = msd
            state["model"] = get_model_state_dict(self.model)
        return state

    def apply(self, state: dict[str, Any]) -> None:
        """Apply a loaded state (in-place filled tensors plus non-tensor parts) to the live objects."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        stepped = self.main if self.main is not None else self.model
        msd = state[MAIN_PARAMS_KEY] if self.main is not None else state["model"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # strict=False: after an unprimed load, parameters that never had a gradient have no
            # optimizer state at all (neither here nor in the saved run); that is correct.
            set_state_dict(stepped, self.opts, model_state_dict=msd, optim_state_dict=state["optimizer"],
                           options=StateDictOptions(strict=False))
            if self.main is not None:
                set_model_state_dict(self.model, state["model"])
        extra = state["extra_state"]
        self.step = int(extra["global_step"])
        self.gen.set_state(extra["rng"])

    # -- the oracle --------------------------------------------------------------------------

    def digest(self) -> str:
        """Every parameter, every moment of every parameter that has had a gradient, every
        param-group hyperparameter, the step and the extra state. A collective under FSDP2
        (full tensors): call it on every rank."""
        h = hashlib.sha256()
        h.update(repr((self.step, self.rank)).encode())
        for module in (self.model, self.main):
            if module is None:
                continue
            for name, p in module.named_parameters():
                h.update(name.encode() + tensor_bytes(p))
        stepped = self.main if self.main is not None else self.model
        names = {id(p): n for n, p in stepped.named_parameters()}
        # never a gradient (unused), or none yet (the late branch before it joins): whatever a load
        # primes there is what a first step would create (zeros, step 0), so it is not compared
        skip = {id(p) for n, p in stepped.named_parameters()
                if n.startswith("unused.") or (n.startswith("late.") and self.step < LATE_FROM)}
        for i, o in enumerate(self.opts):
            for p in sorted((p for g in o.param_groups for p in g["params"]), key=lambda p: names[id(p)]):
                if id(p) in skip:  # never a gradient: whatever a load primes there is never used
                    continue
                for k, v in sorted(o.state.get(p, {}).items()):
                    h.update(f"{i}{names[id(p)]}{k}".encode())
                    h.update(tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
            h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]).encode())
        for k, v in sorted(self.extra().items()):
            h.update(k.encode() + (tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode()))
        return h.hexdigest()


def average_gradients(dist: Any, params: Any, world: int) -> None:
    """Replace every gradient with its mean over the ranks, in fp32: one ``all_reduce`` of all of
    them flattened (a gloo collective costs about 1-2 ms of CPU per rank on a 2-core machine,
    whatever its size: one per parameter made the oracle's training most of a fault cell's cost)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.float().reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


#: The oracle, memoized per process: digests by (config, step, rank, world size, backend), and
#: the latest reference run of each config, which a later, larger step trains on from (training
#: is deterministic: a run trained to k and then to k+2 is the run trained to k+2). Every rank of
#: a world computes a reference together (its training's collectives complete on every rank or
#: on none), so every rank's memo holds the same entries and a hit on one rank is a hit on all.
#: A kept run is tied to the process group it was built in (an FSDP2 run holds that group's
#: device mesh): under another default group it is dropped and the run starts again. Keeping
#: FSDP2 runs matters: the state machine checks every trained step against the oracle, and
#: retraining each from step 0 made its FSDP2 examples quadratic in their length.
_REF_DIGESTS: dict[tuple, str] = {}
_REF_RUNS: dict[tuple, tuple[TrainRun, Any]] = {}
_REF_RUNS_KEPT = 4


def _default_group_ref() -> Any:
    """A weak reference to the default process group (None without one): a kept run is reused
    only while the group it was built in is the default group."""
    import weakref

    dist, _, _ = _dist()
    return None if dist is None else weakref.ref(dist.group.WORLD)


def reference_digest(cfg: RunConfig, step: int) -> str:
    """Digest of an uninterrupted run of ``cfg`` trained to ``step`` (recomputed by training,
    never read from a checkpoint; memoized, see ``_REF_DIGESTS``). Leaves torch's global RNG
    as it found it, computed or not."""
    dist, rank, world = _dist()
    where = (rank, world, dist.get_backend() if dist is not None else None)
    key = (cfg, step, *where)
    digest = _REF_DIGESTS.get(key)
    if digest is not None:
        return digest
    group = _default_group_ref()
    with torch.random.fork_rng(devices=[]):
        kept = _REF_RUNS.pop((cfg, *where), None)
        # weak references compare their live referents; a dead one equals no other
        run = kept[0] if kept is not None and kept[1] == group and kept[0].step <= step else TrainRun(cfg)
        run.train_to(step)
        digest = run.digest()
    _REF_RUNS[(cfg, *where)] = (run, group)
    while len(_REF_RUNS) > _REF_RUNS_KEPT:
        _REF_RUNS.pop(next(iter(_REF_RUNS)))
    _REF_DIGESTS[key] = digest
    return digest


# -- rank functions (run inside faults.world ranks; module level so worlds pickle them) ------

_RUNS: dict[str, dict[str, Any]] = {}


def _errors() -> tuple[type[BaseException], ...]:
    """What a checkpointer may raise: any Exception, and DCP's ``CheckpointException``, which
    derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


#: Prefix of an error string (:func:`_error`) whose exception is not an ``Exception``: the
#: test that gets it back reports a hardening advisory.
NOT_AN_EXCEPTION = "[not an Exception] "


def describe_error(e: BaseException) -> str:
    """``Type: message``, and for DCP's ``CheckpointException`` (whose message names only the
    ranks) each rank's own error, so a report says what failed."""
    text = f"{type(e).__module__}.{type(e).__name__}: {e}"
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for rank, failure in sorted(failures.items(), key=lambda kv: str(kv[0]))[:4]:
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                text += f"; rank {rank}: {type(inner).__name__}: {str(inner)[:300]}"
    return text


def _error(e: BaseException) -> str:
    text = describe_error(e)
    return text if isinstance(e, Exception) else NOT_AN_EXCEPTION + text


def _step_dir(root: str, step: int) -> str:
    """The contract's ``save``/``load`` path: the step directory, never the root."""
    return os.path.join(os.path.abspath(root), step_dir_name(step))


def r_start(run_id: str, cfg: RunConfig, spec: str, ck_kwargs: dict) -> int:
    """Start a fresh run at step 0 in this rank (dropping any other run this rank held)."""
    _RUNS.clear()
    _RUNS[run_id] = {"run": TrainRun(cfg), "ck": load_factory(spec)(**ck_kwargs), "spec": spec, "kw": ck_kwargs}
    return 0


def r_train(run_id: str, k: int) -> tuple[int, str, str]:
    """Train ``k`` steps; return (step, digest, digest of an uninterrupted run to that step)."""
    run: TrainRun = _RUNS[run_id]["run"]
    run.train_to(run.step + k)
    return run.step, run.digest(), reference_digest(run.cfg, run.step)


def _checkpointer(run_id: str, overwrite: bool):
    entry = _RUNS[run_id]
    if not overwrite:
        return entry["ck"]
    entry["ck"].maybe_wait_for_async_save()
    if "ck_over" not in entry:
        entry["ck_over"] = load_factory(entry["spec"])(**{**entry["kw"], "overwrite": True})
    return entry["ck_over"]


def r_save(run_id: str, root: str, save_async: bool, overwrite: bool = False,
           snapshot: str | None = None) -> str | None:
    """Save the current step; None when ``save`` returned, else the error it raised. ``snapshot``:
    passed on when given (``"deferred"``: the capability of that name)."""
    run: TrainRun = _RUNS[run_id]["run"]
    kw = {"snapshot": snapshot} if snapshot else {}
    try:
        _checkpointer(run_id, overwrite).save(_step_dir(root, run.step), run.state(), global_step=run.step,
                                              save_async=save_async, **kw)
    except _errors() as e:  # noqa: BLE001 - reported to the parent, which judges it
        return _error(e)
    return None


def r_wait(run_id: str) -> str | None:
    entry = _RUNS[run_id]
    try:
        for key in ("ck", "ck_over"):
            if key in entry:
                entry[key].maybe_wait_for_async_save()
    except _errors() as e:  # noqa: BLE001
        return _error(e)
    return None


def r_crash_save(run_id: str, root: str, save_async: bool, overwrite: bool, nth: int, when: str,
                 crash_ranks: tuple[int, ...]) -> str | None:
    """Wait for any earlier async save, then save (and wait) with a crash armed at the ``nth``
    file-system operation of the ranks in ``crash_ranks``: the rank reports the moment (:func:`faults.world.emit`) and the parent
    SIGKILLs every rank, as a launcher does when one rank of a job dies. Returns only when the
    save finished before the armed operation came (None) or failed (the error)."""
    import torch.distributed as dist

    from .inject import Action, FaultSpec, patch_os

    spec = FaultSpec("*", "*", when, Action.EMIT, tuple(crash_ranks), nth, f"op{nth}.{when}")
    run: TrainRun = _RUNS[run_id]["run"]
    waited = r_wait(run_id)  # an earlier async save finishes unarmed: the count below is this save's alone
    if waited is not None:
        return waited
    with patch_os(spec, dist.get_rank()):
        try:
            ck = _checkpointer(run_id, overwrite)
            ck.save(_step_dir(root, run.step), run.state(), global_step=run.step, save_async=save_async)
            ck.maybe_wait_for_async_save()
        except _errors() as e:  # noqa: BLE001
            return _error(e)
    return None


def r_resume(run_id: str, cfg: RunConfig, spec: str, ck_kwargs: dict, root: str, unprimed: bool) -> dict[str, Any]:
    """What a restarted job does: wait for the old run's async save (if this rank still has
    one), build fresh objects, ``find_latest_checkpoint`` + ``load``, apply. Returns where it
    landed and the digests to judge it by."""
    out: dict[str, Any] = {"wait_error": None, "path": None, "error": None}
    if run_id in _RUNS:
        out["wait_error"] = r_wait(run_id)
    run = TrainRun(cfg)
    ck = load_factory(spec)(**ck_kwargs)
    _RUNS.clear()
    _RUNS[run_id] = {"run": run, "ck": ck, "spec": spec, "kw": ck_kwargs}
    try:
        path = ck.find_latest_checkpoint(root)
        out["path"] = None if path is None else os.path.normpath(os.path.abspath(path))
        if path is not None:
            state = run.state(unprimed=unprimed, target=True)
            skeleton = state.pop("extra_state")
            loaded = ck.load(path, state, extra_state_skeleton=skeleton)
            run.apply(loaded if isinstance(loaded, dict) else state)
    except _errors() as e:  # noqa: BLE001
        out["error"] = _error(e)
        run = TrainRun(cfg)
        _RUNS[run_id]["run"] = run
    out["step"] = run.step
    out["digest"] = run.digest()
    out["reference"] = reference_digest(cfg, run.step)
    return out


def r_round(run_id: str, root: str) -> dict[str, Any]:
    """One round of a long job with its one checkpointer object: train a step, save it (sync),
    find the newest step and load it into fresh objects with the same checkpointer. Returns the
    error (None when all went through) and this process's open descriptors afterwards."""
    entry = _RUNS[run_id]
    run: TrainRun = entry["run"]
    ck = entry["ck"]
    out: dict[str, Any] = {"error": None}
    try:
        run.train_to(run.step + 1)
        ck.save(_step_dir(root, run.step), run.state(), global_step=run.step, save_async=False)
        path = ck.find_latest_checkpoint(root)
        if path is None:
            raise RuntimeError(f"find_latest_checkpoint found nothing after the save of step {run.step}")
        state = TrainRun(run.cfg).state(target=True)
        skeleton = state.pop("extra_state")
        ck.load(path, state, extra_state_skeleton=skeleton)
    except _errors() as e:  # noqa: BLE001 - reported to the parent, which judges it
        out["error"] = _error(e)
    out["fds"] = len(os.listdir("/proc/self/fd"))
    return out


def r_drop(run_id: str) -> None:
    entry = _RUNS.pop(run_id, None)
    for key in ("ck", "ck_over"):
        if entry is not None and key in entry:
            try:
                entry[key].maybe_wait_for_async_save()
            except _errors():  # noqa: BLE001 - the run is over; its outcome was judged
                pass


# -- process events (faults.suite.test_process_events) -------------------------------------------
def _exit_143(signum: int, frame: Any) -> None:
    """What trainers install for a preemption notice: leave through ``sys.exit``."""
    import sys

    sys.exit(143)


def _outcome_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` did: returned (``raised`` None), or raised -- which class, whether an
    ``Exception``, the message -- and how long it took. Interrupts included: they are the point."""
    import time

    t0 = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"raised": None}
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt and SystemExit are what is judged
        out = {"raised": f"{type(e).__module__}.{type(e).__name__}", "exception": isinstance(e, Exception),
               "interrupt": isinstance(e, (KeyboardInterrupt, SystemExit)), "message": describe_error(e)[:600]}
    out["seconds"] = time.monotonic() - t0
    return out


def r_count_save_ops(run_id: str, root: str) -> int:
    """Save the current step (sync) and count this rank's observable file-system operations."""
    import torch.distributed as dist

    from .inject import Action, FaultSpec, patch_os

    run: TrainRun = _RUNS[run_id]["run"]
    never = FaultSpec("*", "*", "before", Action.HANG, (dist.get_rank(),), 1 << 40, "count")
    with patch_os(never, dist.get_rank()) as t:
        _RUNS[run_id]["ck"].save(_step_dir(root, run.step), run.state(), global_step=run.step, save_async=False)
    return int(sum(t.counts.values()))


def r_interrupted_save(run_id: str, root: str, nth: int, signame: str, ranks: tuple[int, ...]) -> dict[str, Any]:
    """Save the current step (sync) with a real ``signame`` sent to this process at the ``nth``
    file-system operation of the ranks in ``ranks``; Python's own SIGINT handler and a SIGTERM
    handler that calls ``sys.exit(143)`` are installed for the call. What the save did (an
    interrupt held by the checkpointer surfaces by the end of the call, caught here), and whether
    the signal was sent."""
    import signal

    import torch.distributed as dist

    from .inject import Action, FaultSpec, patch_os

    rank = dist.get_rank()
    run: TrainRun = _RUNS[run_id]["run"]
    ck = _RUNS[run_id]["ck"]
    spec = FaultSpec("*", "*", "before", Action.SIGINT if signame == "SIGINT" else Action.SIGTERM, tuple(ranks), nth,
                     f"{signame}@op{nth}")
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    fired = False

    def save() -> None:
        nonlocal fired
        with patch_os(spec, rank) as t:
            try:
                ck.save(_step_dir(root, run.step), run.state(), global_step=run.step, save_async=False)
            finally:
                fired = t.fired

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _exit_143)
        out = _outcome_of(save)
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    out["fired"] = fired
    return out


def r_save_with_bad_extra(run_id: str, root: str, bad_rank: int) -> dict[str, Any]:
    """Save the current step (sync) with extra state that cannot be pickled (a lambda) on
    ``bad_rank`` only: what each rank's save did, and how long it took."""
    import torch.distributed as dist

    run: TrainRun = _RUNS[run_id]["run"]
    ck = _RUNS[run_id]["ck"]
    state = run.state()
    if dist.get_rank() == bad_rank:
        state["extra_state"] = {**state["extra_state"], "callback": lambda: None}
    return _outcome_of(lambda: ck.save(_step_dir(root, run.step), state, global_step=run.step, save_async=False))
