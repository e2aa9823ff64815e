"""``python -m faults torchrun-suite``: the resilience checks that kill no rank, run inside a job
``torchrun`` launched, in its world.

::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        -m faults torchrun-suite --checkpointer package.module:factory --root /shared/dir

Every rank joins the job's world (:class:`faults.world.TorchrunWorld`: env:// rendezvous, the
device of ``LOCAL_RANK`` for NCCL/HCCL) and runs the same checks in lock-step on a checkpoint
root every rank shares (new or empty; checked). Each check drives the suite's rank functions
(:mod:`faults.training`: train, save, wait, resume in fresh objects) and judges what every rank
returned against a run recomputed from scratch, so every rank reaches the same verdict; the
verdicts are then exchanged and compared once more, rank 0 prints the report, and with ``--json``
each rank writes its own copy. Damage between save and resume is done by rank 0 alone, between
two exchanges (which every rank has passed).

Checks (``--checks``, default all):

* ``round_trip``: train, save (sync and async), keep training, wait, resume in fresh objects at
  the job's world size: every rank bitwise at the saved step -- per-rank extra state back to its
  own rank (``per_rank_extra_state`` declared), rank-invariant extra state, FSDP2 (2+ ranks);
* ``newest_complete``: steps 1 and 2 saved, step 2 damaged (commit record deleted, largest payload
  file deleted or truncated, extra state deleted): resume lands bitwise on step 1; the pointer
  damaged (garbage, dangling, stale): resume still lands on step 2;
* ``integrity``: step 2's commit record bit-flipped or truncated: resume lands bitwise on step 1;
  a bit flipped in a model tensor's bytes: no rank loads it without an error.

Not run here: the faults that SIGKILL ranks (every crash state of a save, the state machine's
crashes, power loss, the fault matrix's crash cells). They need a world the harness kills and
starts again; a torchrun job's ranks are torchrun's. Run them with ``pytest --pyargs faults.suite``
(spawned worlds) on any node. Each is reported as a skip with that reason.

Exit status (every rank): 0 every check passed or was skipped; 1 a check failed or the ranks
disagreed; 2 a usage error (not under torchrun, an inconsistent torchrun environment, a root that
is not new or not shared, a checkpointer that cannot be imported). A backend this node cannot
serve (``--backend nccl`` without CUDA devices) is a skip: exit 0, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["CHECKS", "KILL_FAULTS_REASON", "Outcome", "main", "run_suite"]

#: Why the faults that kill ranks are not run inside a torchrun job.
KILL_FAULTS_REASON = (
    "faults that SIGKILL ranks (every crash state of a save, the state machine's crashes, power loss, the "
    "fault matrix's crash cells) need a world the harness kills and starts again; a torchrun job's ranks are "
    "torchrun's to kill and restart -- run them with `pytest --pyargs faults.suite` (spawned worlds)")

#: Step damage of ``newest_complete`` (:func:`faults.strategies.damage_step`): resume falls back to step 1.
STEP_DAMAGE = ("missing_commit", "missing_payload", "truncated_payload", "missing_extra_state")
#: Pointer damage of ``newest_complete`` (:func:`faults.strategies.damage_pointer`): resume still finds step 2.
POINTER_DAMAGE = ("garbage", "dangling", "stale")
#: Commit-record damage of ``integrity``: resume falls back to step 1.
RECORD_DAMAGE = ("bitflip_record", "truncated_record")

#: Marker folder in the root: each rank writes its own file there to prove the root is shared.
_RANKS_DIR = ".torchrun-suite-ranks"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One check's verdict for one checkpointer: ``pass``, ``fail`` or ``skip``, and why."""

    checkpointer: str
    check: str
    status: str
    detail: str = ""


class _Failed(Exception):
    """A check's verdict is ``fail``: ``str(self)`` says which rank saw what."""


class UsageProblem(Exception):
    """The run cannot start here (exit 2): the message says what to change."""


# -- rank functions (module level: a spawned World pickles them by reference) -----------------

def r_root_listing(root: str) -> list[str] | None:
    """What ``root`` holds, as this rank sees it (None: it does not exist)."""
    try:
        return sorted(os.listdir(root))
    except FileNotFoundError:
        return None


def r_mark_root(root: str) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    marks = os.path.join(root, _RANKS_DIR)
    os.makedirs(marks, exist_ok=True)
    with open(os.path.join(marks, str(rank)), "w") as f:
        f.write(f"{rank}\n")
    return rank


def r_seen_marks(root: str) -> list[int]:
    """The ranks whose mark this rank sees in ``root``."""
    try:
        return sorted(int(n) for n in os.listdir(os.path.join(root, _RANKS_DIR)) if n.isdigit())
    except FileNotFoundError:
        return []


def r_damage(root: str, step: int, how: str) -> str | None:
    """Rank 0 damages step ``step`` of ``root`` (``how``: step or pointer damage); the others wait
    at the exchange that ends this run. Returns what was done (rank 0) or None."""
    import torch.distributed as dist

    from .strategies import damage_pointer, damage_step

    if dist.get_rank() != 0:
        return None
    if how in POINTER_DAMAGE:
        damage_pointer(root, how, [1, step])
        return f"pointer {how}"
    from .suite._common import step_path

    where = damage_step(step_path(root, step), how)
    return f"step {step} {how}" + (f" ({where})" if where else "")


# -- the checks (run by the caller of the world: every rank of a torchrun job, in lock-step) ----

@dataclasses.dataclass
class _Ctx:
    world: Any
    spec: str
    caps: frozenset
    root: str

    def sub(self, name: str) -> str:
        return os.path.join(self.root, _slug(self.spec), name)


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", spec)


def _errors_of(results: list[Any], what: str) -> None:
    bad = [(r, e) for r, e in enumerate(results) if e is not None]
    if bad:
        raise _Failed(f"{what} failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad[:4]))


def _save_steps(ctx: _Ctx, rid: str, cfg: Any, root: str, steps: list[int]) -> None:
    from . import training as T

    ctx.world.run(T.r_start, rid, cfg, ctx.spec, {})
    at = 0
    for s in steps:
        ctx.world.run(T.r_train, rid, s - at)
        at = s
        _errors_of(ctx.world.run(T.r_save, rid, root, False), f"save of step {s}")
        _errors_of(ctx.world.run(T.r_wait, rid), f"wait for the save of step {s}")


def _resume(ctx: _Ctx, rid: str, cfg: Any, root: str) -> list[dict[str, Any]]:
    from . import training as T

    results = ctx.world.run(T.r_resume, rid, cfg, ctx.spec, {}, root, False)
    ctx.world.run(T.r_drop, rid)
    return results


def _judge_landed(results: list[dict[str, Any]], root: str, want: int, what: str) -> None:
    from .suite._common import same_path, step_path

    for rank, r in enumerate(results):
        if r["wait_error"] is not None:
            raise _Failed(f"{what}: rank {rank}: the old run's async save failed: {r['wait_error']}")
        if r["error"] is not None:
            raise _Failed(f"{what}: rank {rank}: resume raised {r['error']}")
        if not same_path(r["path"], step_path(root, want)):
            raise _Failed(f"{what}: rank {rank} resumed {r['path']}, the newest complete step is "
                          f"{step_path(root, want)}")
        if r["step"] != want or r["digest"] != r["reference"]:
            raise _Failed(f"{what}: rank {rank}: the state restored from step {want} (extra state says step "
                          f"{r['step']}) differs from an uninterrupted run at that step (parameters, optimizer "
                          "moments, or this rank's own extra state)")


def _round_trip_cases(ctx: _Ctx) -> list[tuple[str, str, Any, str | None]]:
    """(case, mode, config, why skipped or None)."""
    from . import training as T
    from .contract import Capability

    per_rank = T.RunConfig(T.ModelSpec(unused=True), T.OptimSpec(("adamw", "sgd_momentum")))
    invariant = dataclasses.replace(per_rank, extra_per_rank=False)
    fsdp2 = T.RunConfig(T.ModelSpec(depth=2), T.OptimSpec(("adam_amsgrad",)), sharding="fsdp2", extra_per_rank=False)
    no_per_rank = (None if Capability.PER_RANK_EXTRA_STATE in ctx.caps else
                   "checkpointer does not declare capability per_rank_extra_state (faults.contract.Capability)")
    one_rank = "FSDP2 shards over at least 2 ranks" if ctx.world.world_size < 2 else None
    return [("per_rank", "sync", per_rank, no_per_rank), ("per_rank", "async", per_rank, no_per_rank),
            ("rank_invariant", "sync", invariant, None), ("fsdp2", "async", fsdp2, one_rank)]


def check_round_trip(ctx: _Ctx) -> list[Outcome]:
    from . import training as T
    from .suite._common import step_path

    out = []
    for case, mode, cfg, skip in _round_trip_cases(ctx):
        name = f"round_trip[{case},{mode}]"
        if skip is not None:
            out.append(Outcome(ctx.spec, name, "skip", skip))
            continue

        def go(case=case, mode=mode, cfg=cfg) -> str:
            rid, root = f"{ctx.spec}/{case}/{mode}", ctx.sub(f"round_trip-{case}-{mode}")
            ctx.world.run(T.r_start, rid, cfg, ctx.spec, {})
            ctx.world.run(T.r_train, rid, 3)
            _errors_of(ctx.world.run(T.r_save, rid, root, mode == "async"), "save of step 3")
            ctx.world.run(T.r_train, rid, 2)  # training goes on while an async save persists
            _errors_of(ctx.world.run(T.r_wait, rid), "wait for the save of step 3")
            _judge_landed(_resume(ctx, rid, cfg, root), root, 3, f"saved at step 3 ({mode})")
            return f"{ctx.world.world_size} ranks resumed {step_path(root, 3)} bitwise"

        out.append(_outcome(ctx, name, go))
    return out


def check_newest_complete(ctx: _Ctx) -> list[Outcome]:
    from .suite._common import config_for
    from .training import RunConfig

    cfg = config_for(_factory(ctx.spec), RunConfig())
    out = []
    for how in (*STEP_DAMAGE, *POINTER_DAMAGE):
        want = 2 if how in POINTER_DAMAGE else 1

        def go(how=how, want=want) -> str:
            rid, root = f"{ctx.spec}/newest/{how}", ctx.sub(f"newest_complete-{how}")
            _save_steps(ctx, rid, cfg, root, [1, 2])
            done = ctx.world.run(r_damage, root, 2, how)[0]
            _judge_landed(_resume(ctx, rid, cfg, root), root, want, done)
            return f"{done}: every rank resumed step {want} bitwise"

        out.append(_outcome(ctx, f"newest_complete[{how}]", go))
    return out


def check_integrity(ctx: _Ctx) -> list[Outcome]:
    from .suite._common import config_for
    from .training import RunConfig

    cfg = config_for(_factory(ctx.spec), RunConfig())
    out = []
    for how in RECORD_DAMAGE:
        def go(how=how) -> str:
            rid, root = f"{ctx.spec}/integrity/{how}", ctx.sub(f"integrity-{how}")
            _save_steps(ctx, rid, cfg, root, [1, 2])
            done = ctx.world.run(r_damage, root, 2, how)[0]
            _judge_landed(_resume(ctx, rid, cfg, root), root, 1, done)
            return f"{done}: every rank resumed step 1 bitwise"

        out.append(_outcome(ctx, f"integrity[{how}]", go))

    def flipped() -> str:
        from .suite._common import same_path, step_path

        rid, root = f"{ctx.spec}/integrity/bitflip_payload", ctx.sub("integrity-bitflip_payload")
        _save_steps(ctx, rid, cfg, root, [1, 2])
        done = ctx.world.run(r_damage, root, 2, "bitflip_payload")[0]
        results = _resume(ctx, rid, cfg, root)
        for rank, r in enumerate(results):
            if r["error"] is None and same_path(r["path"], step_path(root, 2)):
                differs = "" if r["digest"] == r["reference"] else ", as a state that differs from the one saved"
                raise _Failed(f"{done}: rank {rank} loaded step 2 without an error{differs}")
            if r["error"] is None and r["path"] is not None:
                _judge_landed([r], root, 1, f"{done}, rank {rank} fell back")
        return f"{done}: no rank loaded it silently"

    out.append(_outcome(ctx, "integrity[bitflip_payload]", flipped))
    return out


#: name -> check; each returns one :class:`Outcome` per case.
CHECKS: dict[str, Callable[[_Ctx], list[Outcome]]] = {
    "round_trip": check_round_trip,
    "newest_complete": check_newest_complete,
    "integrity": check_integrity,
}


def _outcome(ctx: _Ctx, name: str, go: Callable[[], str]) -> Outcome:
    from .errors import RankError

    try:
        return Outcome(ctx.spec, name, "pass", go())
    except _Failed as e:
        return Outcome(ctx.spec, name, "fail", str(e))
    except RankError as e:  # a rank function raised past the checkpointer's own errors; the world answered
        first = str(e).split("\n--- remote traceback", 1)[0]
        return Outcome(ctx.spec, name, "fail", f"a rank raised: {first}")


_FACTORIES: dict[str, Any] = {}


def _factory(spec: str) -> Any:
    if spec not in _FACTORIES:
        from .training import load_factory

        _FACTORIES[spec] = load_factory(spec)
    return _FACTORIES[spec]


# -- the run ----------------------------------------------------------------------------------

def prepare_root(world: Any, root: str) -> None:
    """Check that ``root`` is new or empty on every rank and shared by every rank.

    Raises:
        UsageProblem: it is not (the message names the ranks and what they saw).
    """
    listings = world.run(r_root_listing, root)
    busy = [(r, ls) for r, ls in enumerate(listings) if ls]
    if busy:
        r, ls = busy[0]
        raise UsageProblem(f"--root {root} is not empty (rank {r} sees {', '.join(ls[:5])}"
                           f"{' ...' if len(ls) > 5 else ''}); give a new or empty directory")
    world.run(r_mark_root, root)
    seen = world.run(r_seen_marks, root)
    everyone = list(range(world.world_size))
    partial = [(r, s) for r, s in enumerate(seen) if s != everyone]
    if partial:
        r, s = partial[0]
        raise UsageProblem(f"--root {root} is not one directory shared by every rank: rank {r} sees the marks of "
                           f"ranks {s} of {everyone}; give a directory on a file system every node mounts")


def run_suite(world: Any, specs: list[str], root: str, checks: list[str] | None = None,
              say: Callable[[str], None] = lambda line: None) -> list[Outcome]:
    """Run ``checks`` (default all of :data:`CHECKS`) against each checkpointer of ``specs`` in
    ``world`` (a started :class:`~faults.world.TorchrunWorld`, or a spawned
    :class:`~faults.world.World`) on ``root``; ``say`` gets each outcome as it is decided.

    Raises:
        UsageProblem: the root is not new and shared, or a checkpointer cannot be imported.
        WorldError: the world died (a :class:`~faults.world.TorchrunExchangeError`).
    """
    from .contract import capabilities_of

    names = list(CHECKS) if not checks else checks
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UsageProblem(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    for spec in specs:
        try:
            _factory(spec)
        except (ImportError, AttributeError, ValueError) as e:
            raise UsageProblem(f"--checkpointer {spec}: cannot load it ({type(e).__name__}: {e})") from e
    root = os.path.abspath(root)
    prepare_root(world, root)
    outcomes: list[Outcome] = []
    for spec in specs:
        say(spec)
        ctx = _Ctx(world, spec, capabilities_of(_factory(spec)), root)
        for name in names:
            for o in CHECKS[name](ctx):
                outcomes.append(o)
                say(f"  {o.status.upper():4}  {o.check}" + (f": {o.detail}" if o.detail else ""))
        skip = Outcome(spec, "kill_faults", "skip", KILL_FAULTS_REASON)
        outcomes.append(skip)
        say(f"  SKIP  kill_faults: {KILL_FAULTS_REASON}")
    return outcomes


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from .errors import BackendUnavailable, WorldError
    from .world import TorchrunEnvError, TorchrunWorld, torchrun_env

    p = argparse.ArgumentParser(prog="python -m faults torchrun-suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpointer", action="append", required=True, metavar="MODULE:FACTORY",
                   help="the checkpointer to judge (repeatable)")
    p.add_argument("--root", required=True, help="a new or empty directory every rank shares")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "hccl", "auto"),
                   help="process-group backend; nccl/hccl put each rank on the device of its LOCAL_RANK "
                        "(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="the process group's collective timeout (default: %(default)s)")
    p.add_argument("--checks", default="", help=f"comma-separated subset of {', '.join(CHECKS)} (default: all)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON: each rank to PATH with {rank} "
                   "replaced, or rank 0 alone when PATH has no {rank}")
    args = p.parse_args(argv)
    prog = "faults torchrun-suite"

    def error(msg: str) -> int:
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        return 2

    try:
        env = torchrun_env()
        if env is None:
            return error("not a torchrun rank (RANK, WORLD_SIZE, LOCAL_RANK are not set); launch it with torchrun "
                         "--nnodes=N --nproc-per-node=M --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m faults "
                         "torchrun-suite ...")
        world = TorchrunWorld.from_env(args.backend, args.timeout)
    except TorchrunEnvError as e:
        return error(str(e))
    except BackendUnavailable as e:
        print(f"{prog}: SKIP (rank {env.rank if env else '?'}): {e.reason}", flush=True)
        return 0
    rank = world.rank
    # As the pytest suite does (filterwarnings): DCP's and torch's UserWarnings about the harness's
    # tiny models would drown the report, once per rank.
    warnings.filterwarnings("ignore", category=UserWarning)
    say: Callable[[str], None] = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    checks = [c for c in args.checks.split(",") if c] or None
    try:
        with world:
            say(f"{prog}: {world.world_size} ranks ({world.world_size // env.local_world_size} nodes x "
                f"{env.local_world_size}), {world.backend}, restart {env.restart_count}, root {os.path.abspath(args.root)}")
            outcomes = run_suite(world, args.checkpointer, args.root, checks, say)
            mine = [dataclasses.asdict(o) for o in outcomes]
            everyone = world.run(_r_identity, mine)
    except UsageProblem as e:
        return error(str(e))
    except WorldError as e:
        print(f"{prog}: FAIL (rank {rank}): the world failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    agreed = all(o == mine for o in everyone)
    failed = sorted({o.checkpointer for o in outcomes if o.status == "fail"})
    verdict = "pass" if agreed and not failed else "fail"
    summary = (f"verdict: {verdict.upper()}: " + (f"{len(failed)} of {len(args.checkpointer)} checkpointer(s) failed "
               f"({', '.join(failed)})" if failed else f"{len(args.checkpointer)} checkpointer(s) passed")
               + ("; every rank reached the same verdicts" if agreed else
                  "; the ranks DISAGREE (ranks " + ", ".join(str(r) for r, o in enumerate(everyone) if o != mine)
                  + " differ from this one)"))
    say(summary)
    if args.json and (rank == 0 or "{rank}" in args.json):
        _write_json(args.json.replace("{rank}", str(rank)),
                    {"rank": rank, "world_size": world.world_size, "local_rank": world.local_rank,
                     "backend": world.backend, "restart_count": env.restart_count, "verdict": verdict,
                     "agreed": agreed, "failed": failed, "outcomes": mine})
    return 0 if verdict == "pass" else 1


def _r_identity(value: Any) -> Any:
    return value


if __name__ == "__main__":
    raise SystemExit(main())
