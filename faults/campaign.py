"""A seeded random campaign of faults against a checkpointer, in real worlds.

Each round draws a cell of the fault matrix (any kind, step, target, world size, mode) and,
for a third of the crash rounds, composes it with a pointer fault applied after the crash
(a torn or stale pointer on top of a half-finished save). A quarter of the rounds are drawn
among the disk-damage cells alone (commit records flipped, truncated, rewritten or forged;
FIFOs, device nodes and deep trees in a step; torn payloads and pointers), which are few
among the matrix's many crash cells; the rest uniformly from every cell. The same seed
replays the same rounds. The summary counts faults injected, resumes checked, checkpoints
lost and hangs; the last two must be 0. A fault this machine cannot inject (``mknod`` not
permitted) is counted as skipped, not as injected.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time

from .inject import DISK_FAULTS, remove_tree
from .matrix import Cell, Outcome, Worlds, cells, run_cell
from .points import FaultKind

__all__ = ["Summary", "run_campaign"]

_POINTER_FAULTS = (FaultKind.TORN_POINTER, FaultKind.GARBAGE_POINTER, FaultKind.STALE_POINTER,
                   FaultKind.DANGLING_POINTER, FaultKind.EMPTY_POINTER, FaultKind.NUL_POINTER)


@dataclasses.dataclass
class Summary:
    seed: int
    rounds: int = 0
    faults_injected: int = 0
    resumes_checked: int = 0
    checkpoints_lost: int = 0
    hangs: int = 0
    skipped: int = 0
    failures: list[Outcome] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def table(self) -> str:
        rows = [("seed", self.seed), ("rounds", self.rounds), ("faults injected", self.faults_injected),
                ("resumes checked", self.resumes_checked), ("checkpoints lost (must be 0)", self.checkpoints_lost),
                ("hangs (must be 0)", self.hangs), ("failed rounds", len(self.failures)),
                ("skipped (not injectable)", self.skipped),
                ("wall time", f"{self.seconds:.0f} s")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _resumes(cell: Cell) -> int:
    if cell.kind in ("rank_dies_in_collective", "rank_hangs_in_collective"):
        return 0
    return cell.world_size  # every rank resumes and is checked


def run_campaign(seed: int, rounds: int, world_sizes=(1, 2, 4), log=print) -> Summary:
    rng = random.Random(seed)
    pool = cells(world_sizes)
    disk = [c for c in pool if c.kind in {str(k) for k in DISK_FAULTS}]
    summary = Summary(seed)
    worlds = Worlds()
    t0 = time.monotonic()
    try:
        for i in range(rounds):
            cell = rng.choice(disk if rng.random() < 0.25 else pool)
            compose = cell.kind == "crash" and rng.random() < 1 / 3
            extra = rng.choice(_POINTER_FAULTS) if compose else None
            root = tempfile.mkdtemp(prefix="faults-campaign-")
            try:
                outcome = run_cell(cell, worlds, root, seed=rng.randrange(2**31), then=extra)
            finally:
                try:
                    remove_tree(root)  # any depth: a deep_tree round may leave a tree rmtree cannot remove
                except OSError:
                    pass
            summary.rounds += 1
            if outcome.skipped:
                summary.skipped += 1
                log(f"[{i + 1:>3}/{rounds}] skip {cell.id}: {outcome.skipped}")
                continue
            summary.faults_injected += 1 + (extra is not None)
            summary.resumes_checked += _resumes(cell)
            if not outcome.ok:
                summary.failures.append(outcome)
                if any(w in outcome.detail for w in ("resumed", "differs", "acknowledged", "overwritten", "mixes")):
                    summary.checkpoints_lost += 1
                if "WorldTimeout" in outcome.detail or "hang" in outcome.detail:
                    summary.hangs += 1
            log(f"[{i + 1:>3}/{rounds}] {'ok  ' if outcome.ok else 'FAIL'} {cell.id}"
                f"{' + ' + str(extra) if extra else ''} ({outcome.seconds:.1f}s)")
    finally:
        worlds.close()
        summary.seconds = time.monotonic() - t0
    return summary
