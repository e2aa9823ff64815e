"""Power-loss exploration of a save: record it, enumerate the crash states the persistence
model of :mod:`faults.crashsim` allows, materialise each into a real directory and resume
from it with the real checkpointer.

Scenario (every target): step 9 is saved and acknowledged; the save of step 10 is recorded
(refckpt through its I/O layer, :func:`faults.crashsim.recording_io`, at 1, 2 or 4 ranks;
any other checkpointer -- plain DCP's ``FileSystemWriter``, the mutants -- in a subprocess
under ``strace -f``). A crash state at point k guarantees step 9, and step 10 as well once k
is the end of the trace (the save returned: acknowledged). Checked on every state: resume
lands on a complete checkpoint no older than the newest guaranteed one, bitwise equal to what
was saved at that step (recomputed from scratch by :mod:`faults.training`), without failing;
and the pointer is what it was or names a step whose commit record is there (a checkpointer
that validates the pointer survives a torn one, but the protocol that tore it is still wrong:
other readers of the family's pointer file trust it).

    python -m faults powerloss [--world-sizes 1,2,4] [--targets refckpt,dcp,dcp-same-dir] [--budget N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

from . import crashsim as C
from .contract import COMMIT_RECORD, POINTER_FILE, STEP_PREFIX, step_dir_name, step_of
from .training import RunConfig, TrainRun, _errors, load_factory, reference_digest

__all__ = ["Report", "explore_refckpt", "explore_traced", "main"]

CFG = RunConfig()
#: the acknowledged step and the step whose save is explored (two digits -> one: a pointer
#: torn mid-write names another step)
STEP_A, STEP_B = 9, 10


@dataclasses.dataclass
class Report:
    target: str
    world_size: int
    ops: collections.Counter
    states: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unique: int = 0
    landed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)
    acked_lost: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def row(self) -> str:
        ops = sum(self.ops.values())
        kinds = ", ".join(f"{self.states[k]} {k}" for k in ("prefix", "dropped", "reordered", "torn"))
        landed = ", ".join(f"{v} on {k}" for k, v in sorted(self.landed.items()))
        return (f"| {self.target} | {self.world_size} | {ops} ({_ops_text(self.ops)}) | {sum(self.states.values())}: {kinds} "
                f"| {self.unique} | {landed} | {len(self.failures)} | {self.acked_lost} |")


HEADER = ("| target | ranks | operations traced | crash states (by kind) | distinct on disk | resumed | wrong | "
          "acknowledged saves lost |\n|---|---|---|---|---|---|---|---|")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _ops_text(ops: collections.Counter) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(ops.items()))


def _enumerate(root: str, trace: list[C.FOp], budget: int, seed: int, real_root: str | None = None):
    """(model, iops, [(crash state, entries, content, key)]) with states deduplicated by content.
    ``real_root``: the live tree after the save, which the replay of the whole trace must equal."""
    model = C.Model(root)
    iops = model.replay(trace)
    if real_root is not None:
        bad = model.final_tree_problems(real_root)
        if bad:
            raise RuntimeError(f"the recorded trace does not replay to what the save left on disk "
                               f"({len(bad)} differences, e.g. {bad[:3]}): a recorder problem, not a finding")
    states = C.crash_states(trace, iops, budget=budget, seed=seed)
    out: list[tuple[C.CrashState, dict, dict, tuple[str, bool]]] = []
    seen: dict[tuple[str, bool], C.CrashState] = {}
    for cs in states:
        entries, content = C.build_state(model, iops, cs)
        key = (C.state_key(entries, content, model), cs.point == len(trace))
        out.append((cs, entries, content, key))
        seen.setdefault(key, cs)
    return model, iops, out, seen


def _pointer_problem(model: C.Model, entries: dict, content: dict) -> str | None:
    """The protocol's pointer rule in one state: the pointer is what it was before the save, or
    names a step whose commit record is there -- never torn, empty, or ahead of the commit."""
    ino = entries.get((model.root_ino, POINTER_FILE))
    before = model.initial_entries.get((model.root_ino, POINTER_FILE))
    data = content.get(ino) if ino is not None else None
    old = model.initial_content.get(before) if before is not None else None
    if data is None or data == old:
        return None
    text = data.decode("ascii", "replace").strip()
    step_dir = entries.get((model.root_ino, STEP_PREFIX + text)) if text.isdigit() else None
    if step_dir is None or (step_dir, COMMIT_RECORD) not in entries:
        return f"pointer holds {data!r}, which names no complete step"
    return None


def _judge(rep: Report, results: dict, out, trace, iops, model: C.Model) -> None:
    """``results``: key -> per-rank list of (step or None, digest ok, error, fallback warning)."""
    for cs, entries, content, key in out:
        rep.states[cs.kind] += 1
        guaranteed = STEP_B if cs.point == len(trace) else STEP_A
        per_rank = results[key]
        steps = {r[0] for r in per_rank}
        step = per_rank[0][0]
        why = None
        if any(r[2] for r in per_rank):
            why = "resume raised: " + next(r[2] for r in per_rank if r[2])
        elif len(steps) > 1:
            why = f"ranks resumed different steps {sorted(steps, key=str)}"
        elif step is None or step < guaranteed:
            why = f"resumed {'nothing' if step is None else f'step {step}'}; step {guaranteed} was guaranteed"
            notes = sorted({r[3] for r in per_rank if r[3]})
            if notes:
                why += f" (fell back: {notes[0]})"
            rep.acked_lost += 1
        elif not all(r[1] for r in per_rank):
            why = f"step {step} restored wrong bytes"
        else:
            why = _pointer_problem(model, entries, content)
        rep.landed["nothing" if step is None else f"step {step}"] += 1
        if why is not None:
            rep.failures.append(f"{cs.describe(trace, iops)} -> {why}".replace(model.root, "ROOT"))


# -- refckpt, recorded through its I/O layer, at any world size --------------------------------

def _r_save_steps(root: str, steps: list[int]) -> None:
    """Rank function: train and save ``steps``."""
    from refckpt import DistributedCheckpointer

    run = TrainRun(CFG)
    for s in steps:
        run.train_to(s)
        DistributedCheckpointer().save(root, run.state(), global_step=s)


def _r_resume_dirs(dirs: list[str]) -> list[tuple[int | None, bool, str | None, str | None]]:
    """Rank function: ``load_latest`` from each directory in fresh objects."""
    from refckpt import DistributedCheckpointer

    refs: dict[int, str] = {}
    out: list[tuple[int | None, bool, str | None, str | None]] = []
    for d in dirs:
        run = TrainRun(CFG)
        try:
            state = run.state(target=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                path = DistributedCheckpointer(timeout=60).load_latest(d, state)
            fell_back = [str(w.message) for w in caught if "fall" in str(w.message)]
            if path is None:
                out.append((None, True, None, fell_back[0][:300] if fell_back else None))
                continue
            run.apply(state)
            step = run.step
            if step not in refs:
                refs[step] = reference_digest(CFG, step)
            out.append((step, run.digest() == refs[step], None, fell_back[0][:300] if fell_back else None))
        except _errors() as e:  # noqa: BLE001 - judged by the parent
            out.append((None, False, _first_line(e), None))
    return out


def explore_refckpt(world_size: int = 1, *, budget: int = 600, seed: int = 0, world=None, log=None) -> Report:
    from .world import World

    t0 = time.monotonic()
    own = world is None
    world = world or World(world_size, "gloo", 300, start_method="forkserver").start()
    tmp = tempfile.mkdtemp(prefix="faults-powerloss-")
    try:
        root = os.path.join(tmp, "root")
        os.makedirs(root)
        world.run(_r_save_steps, root, [STEP_A])
        model_root = os.path.join(tmp, "before")
        shutil.copytree(root, model_root)  # the tree before the explored save (all durable)
        traces = world.run(_r_record_step2, root)
        trace = _rebase(sorted((op for t in traces for op in t), key=lambda o: o.t), root, model_root)
        rep = Report("refckpt", world_size, collections.Counter(op.kind for op in trace))
        model, iops, out, seen = _enumerate(model_root, trace, budget, seed, real_root=root)
        dirs, keys = [], []
        for i, (key, cs) in enumerate(seen.items()):
            entries, content = C.build_state(model, iops, cs)
            d = os.path.join(tmp, "states", f"{i:05d}")
            model.materialise(entries, content, d)
            dirs.append(d)
            keys.append(key)
        rep.unique = len(dirs)
        per_rank = world.run(_r_resume_dirs, dirs, timeout=3600)
        results = {k: [per_rank[r][i] for r in range(world_size)] for i, k in enumerate(keys)}
        _judge(rep, results, out, trace, iops, model)
    finally:
        if own:
            world.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rep.wall_s = time.monotonic() - t0
    return rep


def _r_record_step2(root: str):
    """Rank function: train to ``STEP_B`` and save it through the recording I/O layer."""
    import torch.distributed as dist

    from refckpt import DistributedCheckpointer

    run = TrainRun(CFG)
    run.train_to(STEP_B)
    trace: list[C.FOp] = []
    lock = os.path.join(os.path.dirname(root), "record.lock")  # outside the explored root
    io = C.recording_io(trace, dist.get_rank(), lock_path=lock if dist.get_world_size() > 1 else None)
    DistributedCheckpointer(io=io).save(root, run.state(), global_step=STEP_B)
    return trace


def _rebase(trace: list[C.FOp], old: str, new: str) -> list[C.FOp]:
    def fix(p: str) -> str:
        return new + p[len(old):] if p == old or p.startswith(old + os.sep) else p

    return [dataclasses.replace(op, path=fix(op.path), path2=fix(op.path2)) for op in trace]


# -- any checkpointer, recorded with strace ----------------------------------------------------

class PlainDCP:
    """Plain DCP as a harness checkpointer: ``dcp.save`` with its default ``FileSystemWriter``
    into ``global_step_N`` (or one fixed directory, ``same_dir``); resume = the newest directory
    holding ``.metadata``. No pointer, no staging, nothing of refckpt."""

    def __init__(self, same_dir: bool = False) -> None:
        self.same_dir = same_dir

    def _dir(self, root: str, step: int) -> str:
        return os.path.join(root, "checkpoint" if self.same_dir else step_dir_name(step))

    def save(self, root: str, state: dict, *, global_step: int, save_async: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=self._dir(root, global_step), no_dist=True)

    def maybe_wait_for_async_save(self) -> None:
        pass

    def find_latest_checkpoint(self, root: str) -> str | None:
        cands = []
        for n in os.listdir(root):
            d = os.path.join(root, n)
            if os.path.isfile(os.path.join(d, COMMIT_RECORD)):
                cands.append(d)

        def step(d: str) -> int:
            n = step_of(os.path.basename(d))
            return -1 if n is None else n

        return max(cands, key=step, default=None)

    def load(self, path: str, state: dict, **_: Any) -> dict:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=path, no_dist=True)
        return state


def plain_dcp(**kw) -> PlainDCP:
    return PlainDCP(**kw)


def plain_dcp_same_dir(**kw) -> PlainDCP:
    return PlainDCP(same_dir=True, **kw)


TARGETS = {"dcp": "faults.powerloss:plain_dcp", "dcp-same-dir": "faults.powerloss:plain_dcp_same_dir"}


def _save_main(spec: str, root: str, step: int) -> None:
    """Subprocess entry: train to ``step`` and save it with the checkpointer ``spec``."""
    warnings.simplefilter("ignore")
    ck = load_factory(spec)()
    run = TrainRun(CFG)
    run.train_to(step)
    ck.save(root, run.state(), global_step=step)
    ck.maybe_wait_for_async_save()


def _resume_one(spec: str, d: str, refs: dict) -> tuple[int | None, bool, str | None, None]:
    try:
        ck = load_factory(spec)()
        run = TrainRun(CFG)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = ck.find_latest_checkpoint(d)
            if path is None:
                return (None, True, None, None)
            state = run.state(target=True)
            ck.load(path, state)
        run.apply(state)
        if run.step not in refs:
            refs[run.step] = reference_digest(CFG, run.step)
        return (run.step, run.digest() == refs[run.step], None, None)
    except _errors() as e:  # noqa: BLE001
        return (None, False, _first_line(e), None)


def explore_traced(spec: str, *, name: str | None = None, budget: int = 600, seed: int = 0, cwd: str | None = None) -> Report:
    """Explore a checkpointer named ``module:factory`` by tracing its save with strace."""
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="faults-powerloss-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([cwd or os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    try:
        root = os.path.join(tmp, "root")
        os.makedirs(root)
        argv = [sys.executable, "-c", "import sys; from faults.powerloss import _save_main; "
                "_save_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))", spec, root]
        if cwd and cwd not in sys.path:
            sys.path.insert(0, cwd)
        _save_main(spec, root, STEP_A)  # the acknowledged step: saved here, only the explored save is traced
        before = os.path.join(tmp, "before")
        shutil.copytree(root, before)
        raw = C.strace_record(argv + [str(STEP_B)], env=env, cwd=cwd)
        trace = _rebase([op for op in raw if op.path.startswith(root) or op.path2.startswith(root)
                         or op.kind in ("write", "fsync", "truncate")], root, before)
        rep = Report(name or spec, 1, collections.Counter(op.kind for op in trace if op.kind != "open" or op.create or op.trunc))
        model, iops, out, seen = _enumerate(before, trace, budget, seed, real_root=root)
        refs: dict = {}
        results = {}
        for i, (key, cs) in enumerate(seen.items()):
            entries, content = C.build_state(model, iops, cs)
            d = os.path.join(tmp, "states", f"{i:05d}")
            model.materialise(entries, content, d)
            results[key] = [_resume_one(spec, d, refs)]
        rep.unique = len(seen)
        _judge(rep, results, out, trace, iops, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rep.wall_s = time.monotonic() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m faults powerloss", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="1,2,4", help="refckpt's world sizes (default 1,2,4)")
    ap.add_argument("--targets", default="refckpt,dcp,dcp-same-dir",
                    help="refckpt, dcp, dcp-same-dir, or module:factory (traced with strace)")
    ap.add_argument("--budget", type=int, default=600, help="crash states per exploration before sampling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expect-fail", action="store_true", help="exit 0 only if every target is caught")
    ap.add_argument("--show", type=int, default=3, help="counterexamples printed per target")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    reports = []
    for target in args.targets.split(","):
        if target == "refckpt":
            for n in (int(x) for x in args.world_sizes.split(",")):
                reports.append(explore_refckpt(n, budget=args.budget, seed=args.seed))
        else:
            reports.append(explore_traced(TARGETS.get(target, target), name=target, budget=args.budget, seed=args.seed))
        r = reports[-1]
        print(f"{r.target} at {r.world_size} rank(s): {sum(r.states.values())} states, {len(r.failures)} wrong, "
              f"{r.wall_s:.0f} s", file=sys.stderr, flush=True)
    print(HEADER)
    for r in reports:
        print(r.row())
    for r in reports:
        for f in r.failures[: args.show]:
            print(f"COUNTEREXAMPLE {r.target}: {f}")
    caught = [not r.ok for r in reports]
    return 0 if (all(caught) if args.expect_fail else not any(caught)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
