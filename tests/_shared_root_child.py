"""Child processes for tests/test_shared_root.py: a reader holding a lease, a save stopped mid-shard.

    python tests/_shared_root_child.py lease ROOT STEP_NAME     take a lease, print its path, wait for stdin to close
    python tests/_shared_root_child.py stuck ROOT STEP           save STEP, stop inside the shard write: print
                                                                 "writing", wait for stdin to close (killed there)
    python tests/_shared_root_child.py saves ROOT FIRST EVERY N  save steps FIRST, FIRST+EVERY, ... (N saves),
                                                                 print each step's outcome ("ok N" / "failed N: ...")
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from refckpt import DistributedCheckpointer, get_training_state  # noqa: E402
from refckpt.durable import FileIO  # noqa: E402
from refckpt.holders import take_lease  # noqa: E402
from refckpt.protocol import SavePoint  # noqa: E402


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return get_training_state(model, opt, {})


class _StopInShards(FileIO):
    def mark(self, point: str, **info) -> None:
        if point == SavePoint.SHARDS:
            print("writing", flush=True)
            sys.stdin.read()  # until the parent kills us (or closes stdin)
            os._exit(3)


def main(argv: list[str]) -> int:
    kind, root = argv[0], argv[1]
    if kind == "lease":
        print(take_lease(root, argv[2]), flush=True)
        sys.stdin.read()
        return 0
    if kind == "stuck":
        DistributedCheckpointer(io=_StopInShards()).save(root, _state(int(argv[2])), global_step=int(argv[2]))
        return 1
    if kind == "saves":
        first, every, n = (int(a) for a in argv[2:5])
        keep = int(argv[5]) if len(argv) > 5 else None
        ck = DistributedCheckpointer(keep_last=keep)
        for i in range(n):
            step = first + i * every
            try:
                ck.save(root, _state(step), global_step=step)
                print(f"ok {step}", flush=True)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                print(f"failed {step}: {type(e).__name__}: {e}", flush=True)
        return 0
    raise SystemExit(f"unknown kind {kind}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
