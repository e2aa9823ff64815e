"""``refckpt`` command line (also ``python -m refckpt``).

This module only parses arguments and prints: the work is done by :mod:`refckpt.tools.readers`
(ls, verify, inspect), :mod:`refckpt.tools.convert` and :mod:`refckpt.tools.example`, which return
data and log through ``logging.getLogger("refckpt...")``. The crash demonstration needs the fault
harness and lives there: ``python -m faults demo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["main", "ProgressBar", "human_size", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

_EPILOG = """\
exit codes:
  0  success (ls listed the root, verify found every step intact, example checks held)
  1  a problem was found (verify: a damaged or incomplete step; inspect: an item could not be
     read; example: a restored state differs)
  2  usage error or bad input (a path that does not exist or is not a checkpoint, an
     unknown input to convert, contradictory options); the message names the path and the fix

commands:
  refckpt ls ROOT                every step, complete or why not, size, world size, what resume picks
  refckpt verify PATH|ROOT       re-read every byte against the commit record's checksums
  refckpt inspect PATH           keys, shapes, dtypes, chunks, optimizer kind, extra-state keys
  refckpt convert PATH OUT       refckpt/DCP -> one safetensors file; torch.save/DCP -> refckpt
  refckpt example                train on N gloo ranks with checkpoints, resume in fresh processes
"""


#: subcommand -> (one-line help, description).
_COMMANDS = {
    "example": (
        "train on 2 gloo ranks with checkpoints, resume in fresh processes, show what was restored",
        "Train a small model on N gloo ranks with periodic checkpoints, stop, resume in fresh processes "
        "from the newest complete checkpoint, and check the restored state bitwise."),
    "ls": (
        "list the step directories of a checkpoint root and what resume would pick",
        "List every global_step_N under ROOT, newest first: complete, incomplete or corrupt (and why), "
        "size, world size (~N: inferred from file names), extra-state layout, format; the pointer file "
        "and what it means; and the step resume would load (find_latest_checkpoint). Reads commit "
        "records and file sizes only; `refckpt verify` reads every byte. A root of more than 100 step "
        "directories is summarised: the newest 100 are examined, the older ones counted by name "
        "(--limit N, or --all to examine every one). A step deleted while ls reads it (retention of "
        "a running save) is listed as gone, never as damaged."),
    "verify": (
        "re-read every byte of a step (or of every step under a root) against its checksums",
        "Check that PATH (a step directory) or every step under ROOT is complete and that every byte "
        "matches the checksums (CRC-32C) its commit record holds. Problems name the file and what is wrong; exit 1 "
        "if there is any. Checkpoints not written by refckpt carry no checksums: every item is read "
        "and parsed instead. While it reads a step, verify holds a reader's lease in the root that "
        "retention of a running save respects; a step deleted or replaced while it is read anyway is "
        "reported as gone, and only damage that is still there makes verify exit 1."),
    "inspect": (
        "show keys, shapes, dtypes, chunks, optimizer kinds and extra-state keys of a step",
        "Show what a step holds: every saved key with shape, dtype and chunks (offsets+sizes@file, one "
        "per saving rank for sharded tensors), the optimizer kind of each param group (from its state "
        "entries: exp_avg/exp_avg_sq, momentum_buffer, square_avg, sum, ...) with its hyperparameters, "
        "and the extra-state keys (read with the safe loader; nothing from the checkpoint is executed). "
        "A ROOT shows the step resume would load."),
    "convert": (
        "refckpt step -> one safetensors file; torch.save file or plain DCP dir -> refckpt layout",
        "Convert PATH into OUT; the direction follows the input:\n"
        "  refckpt step directory (or root: the step resume picks)  -> OUT, one consolidated safetensors file\n"
        "  plain DCP directory (.metadata + *.distcp)                -> OUT.safetensors if OUT ends so,\n"
        "                                                              else OUT is a root: OUT/global_step_N\n"
        "  torch.save file (read with weights_only=True only)        -> OUT is a root: OUT/global_step_N\n"
        "Shards are consolidated by DCP in this process; checksums are verified while reading. Steps "
        "written into a root are saved by DistributedCheckpointer, so they carry the commit record, "
        "checksums and the pointer.\n\n"
        "A torch.save of {'model': model.state_dict(), 'optimizer': opt.state_dict()}: the optimizer state, "
        "keyed there by parameter index, is written keyed by parameter name, as get_training_state asks for "
        "it on resume (Adam's moments and step counters included). The ids of the param groups are paired, "
        "in order, with the model's parameters (its state dict less BatchNorm's running statistics). Where "
        "that is not safe (several param groups, counts that differ, a moment whose shape is not its "
        "parameter's), convert refuses: pass --param-names FILE, one name per line in the optimizer's order:\n"
        "  [n for g in opt.param_groups for p in g['params'] for n, q in model.named_parameters() if q is p]"),
}


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``, or a usage error naming ``what`` is expected."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


_positive = _int_at_least(1, "a positive integer")

_step = _int_at_least(0, "a step number (an integer >= 0)")


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _table(rows: list[list[str]], out: TextIO, indent: str = "") -> None:
    """Left-aligned columns; the last column is free text and not padded."""
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]
        print((indent + "  ".join(cells)).rstrip(), file=out)


def _json(data: Any, out: TextIO) -> None:
    print(json.dumps(data, indent=2, default=str), file=out)


class ProgressBar:
    """A one-line ``\\r`` progress bar on a stream (stderr): no dependency, no terminal codes."""

    #: columns when ``stream`` is not a terminal (``--progress`` into a log file).
    DEFAULT_WIDTH = 100

    def __init__(self, stream: TextIO, width: int | None = None) -> None:
        self.stream = stream
        if width is None:
            try:
                width = os.get_terminal_size(stream.fileno()).columns
            except (OSError, ValueError, AttributeError):  # not a terminal, or no file descriptor
                width = self.DEFAULT_WIDTH
        self.width = max(40, width)
        self._last = ""
        self._used = False

    def __call__(self, done: int, total: int, what: str) -> None:
        frac = 1.0 if total <= 0 else min(done / total, 1.0)
        bar = "#" * int(frac * 24)
        head = f"[{bar:<24}] {frac * 100:3.0f}% {human_size(done)}/{human_size(total)} "
        room = max(self.width - 1 - len(head), 8)
        line = head + (what if len(what) <= room else "..." + what[-(room - 3):])  # keep the file name
        pad = " " * max(0, len(self._last) - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._last, self._used = line, True

    def close(self) -> None:
        if self._used:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self.stream.flush()


# -- commands ----------------------------------------------------------------------------------
def _cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    from .readers import LS_LIMIT, STATE_COMPLETE, STEP_PREFIX, list_root

    listing = list_root(args.root, limit=None if args.all else args.limit or LS_LIMIT)
    if args.json:
        _json(listing.to_json(), out)
        return EXIT_OK
    p = listing.pointer
    raw = "(absent)" if p.raw is None else json.dumps(p.raw.strip() if p.step is not None else p.raw)
    print(f"root     {listing.root}", file=out)
    print(f"pointer  {os.path.basename(p.file)} = {raw}: {p.note}", file=out)
    print(f"resume   {os.path.basename(listing.resume) if listing.resume else 'nothing (no complete step)'}", file=out)
    if not listing.steps:
        print(f"no step directories (global_step_N) under {listing.root}", file=out)
    else:
        print(file=out)
        rows = [["STEP", "STATE", "SIZE", "WORLD", "EXTRA STATE", "FORMAT", "RECORD", "NOTE"]]
        for s in listing.steps:
            world = ("-" if s.world_size is None
                     else str(s.world_size) if s.world_size_source == "manifest" else f"~{s.world_size}")
            note = "<- resume" if s.path == listing.resume else (s.reason if s.state != STATE_COMPLETE else "")
            rows.append([str(s.step), s.state, human_size(s.size_bytes), world,
                         (s.extra_state or "-").replace("_", "-"), s.format or "-",
                         s.record_checksum or ("unchecked" if s.format else "-"), note])
        _table(rows, out)
    if listing.not_examined_steps is not None:
        lo, hi = listing.not_examined_steps
        print(f"... and {listing.not_examined} older step directories ({STEP_PREFIX}{lo} .. {STEP_PREFIX}{hi}) not "
              f"examined: `refckpt ls --all {listing.root}` examines every one", file=out)
    for name in listing.gone:
        print(f"gone     {name}: deleted while ls read it (retention of a running save)", file=out)
    for name, status in zip(listing.staging, listing.staging_status or [""] * len(listing.staging), strict=True):
        print(f"staging  {name}: {status or 'a save in flight or interrupted; readers ignore it'}", file=out)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    from .readers import verify

    bar = ProgressBar(sys.stderr) if (args.progress or sys.stderr.isatty()) and not args.quiet else None
    try:
        report = verify(args.path, on_progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        _json(report.to_json(), out)
        return EXIT_OK if report.ok else EXIT_PROBLEM
    for s in report.steps:
        name = os.path.basename(s.path)
        if s.gone:
            if not args.quiet:
                print(f"{name}: gone (deleted or replaced while verify read it: retention of a running save); "
                      f"not checked", file=out)
        elif s.ok and not args.quiet:
            how = {"crc32c": "every byte matches its crc32c", "crc32": "every byte matches its crc32",
                   "sizes": "sizes match (saved without checksums: bytes not checked)",
                   "parsed": "no checksums recorded (not written by refckpt): every item read and parsed"}[s.checked]
            record = ("commit record matches its sha256" if s.record == "sha256"
                      else "commit record carries no checksum (written before refckpt/2 or by plain DCP): structure checked")
            print(f"{name}: OK ({s.files} files, {human_size(s.bytes_read)}; {how}; {record})", file=out)
        elif not s.ok:
            print(f"{name}: FAIL", file=out)
            for problem in s.problems:
                print(f"  {problem}", file=out)
    if not args.quiet:
        bad = sum(not s.ok for s in report.steps)
        gone = sum(s.gone for s in report.steps)
        checked = len(report.steps) - gone
        summary = (f"all {checked} step(s) intact" if report.ok
                   else f"{bad} of {checked} step(s) have problems")
        if gone:
            summary += f" ({gone} gone while read)"
        if report.kind == "root":
            summary += f"; resume would load {os.path.basename(report.resume) if report.resume else 'nothing'}"
        print(summary, file=out)
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _natural(path: list) -> list:
    """Sort key: ``layers.10`` after ``layers.9``."""
    return [(0, int(p), "") if isinstance(p, int) or str(p).isdigit() else (1, 0, str(p))
            for part in path for p in re.split(r"\.", str(part))]


def _chunks(e: dict[str, Any]) -> str:
    chunks = e["chunks"]
    if len(chunks) == 1 and not any(chunks[0]["offsets"]) and chunks[0]["sizes"] == e["shape"]:
        return f"1 (whole, {chunks[0]['file']})"
    shown = "; ".join(f"{c['offsets']}+{c['sizes']}@{c['file']}" for c in chunks[:4])
    return f"{len(chunks)}: {shown}" + (" ..." if len(chunks) > 4 else "")


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    from .readers import inspect_step

    info = inspect_step(args.path)
    if args.json:
        _json(info, out)
        return EXIT_PROBLEM if info["errors"] else EXIT_OK
    if info["note"]:
        print(info["note"], file=out)
    world = "-" if info["world_size"] is None else info["world_size"]
    print(f"{os.path.basename(info['path'])}  {info['path']}", file=out)
    print(f"  {info['state']}, format {info['format']}, world size {world}, "
          f"checksums {info['checksums'] or 'none'}, record checksum {info['record_checksum'] or 'none'}", file=out)
    if info["records"]:
        print(f"  committed per rank: {', '.join(info['records'])} (each lists its own rank's items)", file=out)
    for top, counts in info["tops"].items():
        entries = [e for e in info["entries"] if e["top"] == top]
        head = f"{top}: {counts['tensors']} tensors, {human_size(counts['nbytes'])}"
        if counts["items"]:
            head += f", {counts['items']} non-tensor items"
        opt = info["optimizer"] if top == "optimizer" else None
        if opt:
            head += f"; kind {opt['kind']}"
        print(f"\n{head}", file=out)
        if opt:
            for i, g in enumerate(opt["groups"]):
                hyper = " ".join(f"{k}={v}" for k, v in g["hyperparameters"].items())
                print(f"  group {i}: {g['kind']}, {g['params']} params ({g['params_with_state']} with state): {hyper}", file=out)
            print(f"  state entries: {', '.join(opt['state_entries']) or '(none)'} "
                  f"for {opt['params_with_state']} params", file=out)
        per_rank = bool(info["records"])  # committed per rank: a key may appear in every record
        rows = [["KEY", "SHAPE", "DTYPE", "CHUNKS"] + (["RECORD"] if per_rank else [])]
        for e in sorted(entries, key=lambda e: (_natural(e["path"][1:]), e.get("record", ""))):  # layer order
            key = ".".join(map(str, e["path"][1:])) or e["key"]
            tail = [e["record"]] if per_rank else []
            if e["kind"] == "tensor":
                rows.append([key, str(e["shape"]), e["dtype"], _chunks(e)] + tail)
            elif not (opt and key.startswith("param_groups.")):
                rows.append([key, "-", "(non-tensor)", f"{e['length']} B in {e['file']}"] + tail)
        if len(rows) > 1:
            _table(rows, out, indent="  ")
    extra = info["extra_state"]
    if extra["layout"] not in (None, "none"):
        where = (f"{extra['files']} per-rank file(s), read from {extra.get('read_from', 'rank 0')}"
                 if extra["layout"] == "per_rank" else "embedded in the DCP payload")
        print(f"\nextra_state ({where}):", file=out)
        for k, v in extra["keys"].items():
            print(f"  {k}: {v}", file=out)
    else:
        print("\nextra_state: none saved", file=out)
    for err in info["errors"]:
        print(f"problem: {err}", file=sys.stderr)
    return EXIT_PROBLEM if info["errors"] else EXIT_OK


def _cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    from .convert import convert

    res = convert(args.path, args.out, step=args.step, with_optimizer=args.with_optimizer,
                  force=args.force, drop_extra_state=args.drop_extra_state, param_names=args.param_names)
    what = ("one safetensors file" if res.out_kind == "safetensors"
            else "refckpt step (commit record, checksums, pointer)")
    print(f"read {res.source} ({res.source_kind})", file=out)
    print(f"wrote {res.out}: {what}, {res.tensors} tensors, {human_size(res.bytes)}", file=out)
    for note in res.notes:
        print(f"  note: {note}", file=out)
    return EXIT_OK


def _cmd_example(args: argparse.Namespace, out: TextIO) -> int:
    from .example import run_example

    return run_example(args.dir, args.world_size, args.steps, args.every)


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="refckpt", description="Reference distributed checkpointer for PyTorch.",
                                epilog=_EPILOG, formatter_class=fmt)
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does (INFO) to stderr")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace, TextIO], int],
            path: tuple[str, str, str] | None = None, json_flag: bool = False):
        """A subcommand with its text from _COMMANDS; ``path``: (dest, metavar, help) of its positional path."""
        help, description = _COMMANDS[name]
        sp = sub.add_parser(name, help=help, description=description, epilog=_EPILOG.split("\ncommands:")[0],
                            formatter_class=fmt)
        sp.set_defaults(fn=fn)
        if path is not None:
            sp.add_argument(path[0], metavar=path[1], help=path[2])
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print machine-readable JSON")
        return sp

    ex = add("example", _cmd_example)
    ex.add_argument("--dir", help="checkpoint root (default: a new temp dir)")
    ex.add_argument("--world-size", type=_positive, default=2)
    ex.add_argument("--steps", type=_positive, default=10)
    ex.add_argument("--every", type=_positive, default=4)

    ls = add("ls", _cmd_ls, ("root", "ROOT", "checkpoint root (the directory that holds global_step_N/)"), json_flag=True)
    ls.add_argument("--limit", type=_positive, default=None, metavar="N",
                    help="examine the newest N step directories; count older ones by name (default 100)")
    ls.add_argument("--all", action="store_true", help="examine every step directory, however many")

    ve = add("verify", _cmd_verify, ("path", "PATH|ROOT", "a step directory or a checkpoint root"), json_flag=True)
    ve.add_argument("--progress", action="store_true", help="draw a progress bar on stderr even when it is not a terminal")
    ve.add_argument("--quiet", action="store_true", help="print problems only (no progress bar, no per-step OK lines)")

    add("inspect", _cmd_inspect, ("path", "PATH", "a step directory (or a root: its newest complete step)"), json_flag=True)

    cv = add("convert", _cmd_convert,
             ("path", "PATH", "a refckpt step directory or root, a plain DCP directory, or a torch.save file"))
    cv.add_argument("out", metavar="OUT", help="the safetensors file, or the checkpoint root, to write")
    cv.add_argument("--with-optimizer", action="store_true",
                    help="safetensors output: add optimizer tensors under flattened keys (optimizer.state.<param>.<entry>)")
    cv.add_argument("--step", type=_step, default=None, help="refckpt output: the step number to write (default 0)")
    cv.add_argument("--force", action="store_true",
                    help="replace an existing OUT file, or overwrite a complete step N (the old one stays resumable "
                         "until the new one is committed)")
    cv.add_argument("--drop-extra-state", action="store_true",
                    help="DCP input with several per-rank extra-state files: convert model and optimizer only")
    cv.add_argument("--param-names", metavar="FILE", default=None,
                    help="torch.save input: the optimizer's parameter names, one per line in its parameter order "
                         "(the concatenated param groups'), to key its state by name where convert cannot pair "
                         "ids with the model's parameters itself")

    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="refckpt: %(levelname)s: %(name)s: %(message)s",
                            stream=sys.stderr)
    if args.verbose:
        logging.getLogger("refckpt").setLevel(logging.INFO)
    from ..errors import CheckpointError

    try:
        return args.fn(args, sys.stdout)
    except (CheckpointError, OSError) as e:
        print(f"refckpt {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
