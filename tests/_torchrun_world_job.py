"""A job ``torchrun`` launches to exercise :class:`faults.world.TorchrunWorld` itself.

Run by ``tests/test_torchrun_suite.py`` as a script (never imported by pytest). Every rank makes
the world from the environment and, in lock-step: gathers each rank's identity, runs a function
that raises on rank 1 only (every rank must get the same ``RankError``), the same with
``collect_failures=True``, then an ``all_reduce`` in the default group (the world stays usable
after a rank's error). Each rank writes ``<out>/<incarnation>_<rank>.json`` (tmp + rename).
In the first incarnation rank 1 then exits with code 3, so that torchrun (``--max-restarts=1``)
restarts the group: the second incarnation joins a fresh default group under its own store
prefix on torchrun's shared agent store (pytorch#135712) and does the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from faults.errors import RankError
from faults.world import World


def identity() -> tuple[int, int, int, str]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), os.environ["GROUP_RANK"]


def fail_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return dist.get_rank()


def sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    world = World.from_env("gloo", timeout=60)
    incarnation = world.env.restart_count
    with world:
        record: dict = {"identity": world.run(identity), "store_prefix": world.env.store_prefix}
        try:
            world.run(fail_on_rank_1)
            record["raised"] = None
        except RankError as e:
            record["raised"] = [e.rank, e.exc_type, e.exc_message, sorted(e.errors)]
        collected = world.run(fail_on_rank_1, collect_failures=True)
        record["collected"] = [c if not isinstance(c, RankError) else f"RankError {c.rank} {c.exc_message}"
                               for c in collected]
        record["sum"] = world.run(sum_of_ranks)
        record["alive"] = world.alive
        path = os.path.join(out, f"{incarnation}_{world.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    if incarnation == 0 and world.rank == 1:
        return 3  # torchrun restarts the group
    return 0


if __name__ == "__main__":
    sys.exit(main())
