"""``refckpt`` command line (also ``python -m refckpt``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="refckpt", description="Reference distributed checkpointer for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("example", help="train on 2 gloo ranks with checkpoints, resume in fresh processes, show what was restored")
    ex.add_argument("--dir", help="checkpoint root (default: a new temp dir)")
    ex.add_argument("--world-size", type=_positive, default=2)
    ex.add_argument("--steps", type=_positive, default=10)
    ex.add_argument("--every", type=_positive, default=4)
    args = p.parse_args(argv)
    if args.cmd == "example":
        from .example import run_example

        return run_example(args.dir, args.world_size, args.steps, args.every)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
