"""Seeded single-bit flips in a real checkpoint: resume is bitwise right, falls back, or says why.

One small two-step checkpoint is saved through :class:`refckpt.DistributedCheckpointer` in
this process (a tiny model and an AdamW that stepped, per-rank extra state with an RNG state),
and what was saved is kept from *before* each save (cloned tensors, the extra-state dict): the
oracle never comes from the checkpointer. Each flip picks a file of the newest step -- its
commit record ``.metadata`` (half of the flips), its extra-state file or its shard's
safetensors header (a quarter each) -- and flips one bit at a seeded position; then
``DistributedCheckpointer().load_latest(root, fresh_state)`` resumes, in a forked child under
``RLIMIT_AS`` (its address space at the fork plus 1.5 GiB) with a wall-clock limit per flip.
Every flip is reproducible from ``(seed, index)`` (and the record's size, the same on every
run: see :func:`survey`).

Each outcome is one of:

* ``identical``: loaded the newest step, bitwise equal to what was saved there;
* ``fallback``: loaded the previous step, bitwise equal to what was saved there;
* ``clear_error``: raised a :class:`refckpt.errors.CheckpointError` subclass;
* ``other``: anything else -- a silent difference, ``None`` (a step lost), an exception that
  is not a ``CheckpointError``, a ``MemoryError`` or ``RecursionError`` (also one the library
  caught and turned into a fallback or a ``CheckpointError``: parsing a 9 KB record must not
  try to allocate gigabytes), a timeout, a crash of the child.

The property: no ``other``. The survey (counts per class and file, the causes of ``other``)
is printed: ``pytest tests/test_record_flips.py -s`` (or ``-rA``, which shows captured output
of passing tests).

Profiles:

* default: 120 flips (a few seconds; part of the repository's ``pytest -n 8``);
* ``pytest tests/test_record_flips.py --record-flips 1000 -s``: the slower survey
  (``--record-flips-seed S`` draws other flips);
* ``python -m tests.test_record_flips 1000 [--seed S] [--jobs J]``: the same survey as a
  command, printing the table (exit status 1 when any flip is ``other``); run it against
  another refckpt (an older commit) to compare before and after figures.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import logging
import os
import random
import resource
import select
import shutil
import signal
import struct
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch

CLASSES = ("identical", "fallback", "clear_error", "other")
TARGETS = (("record", 2), ("extra", 1), ("shard_header", 1))  # (file, weight)
DEFAULT_FLIPS = 120
FLIP_TIMEOUT = 20.0  # seconds one resume may take before it counts as a hang
ADDRESS_SPACE_MARGIN = 3 << 29  # 1.5 GiB above the address space at the fork

_STEP_FILES = {
    "record": ".metadata",
    "extra": os.path.join("extra_state", "extra_state_rank_0.pt"),
    "shard_header": "__0_0.safetensors",
}


# -- the checkpoint and what was saved in it ------------------------------------------------------

def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested state, tensors cloned: what a load must reproduce bitwise."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj.detach().clone()
    else:
        out[prefix[:-1]] = obj
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                           b.detach().contiguous().reshape(-1).view(torch.uint8))
    return type(a) is type(b) and a == b


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    keys = sorted(set(got) | set(want))
    return [k for k in keys if k not in got or k not in want or not _same(got[k], want[k])]


@dataclasses.dataclass
class Template:
    """A saved two-step checkpoint and the state saved at each step (kept before saving)."""

    root: str
    kept: dict[int, dict[str, Any]]

    @property
    def newest(self) -> str:
        return os.path.join(self.root, "global_step_2")


def build_checkpoint(root: str) -> Template:
    from refckpt import DistributedCheckpointer, get_training_state

    model, opt = _model_and_optimizer(0)
    ck = DistributedCheckpointer()
    kept: dict[int, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(1234)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (1, 2):
            loss = model(torch.randn(4, 5, generator=g)).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            extra = {"global_step": step, "rng": g.get_state(), "data_position": 1000 + 17 * step,
                     "note": f"after step {step}"}
            state = get_training_state(model, opt, extra)
            kept[step] = _flatten(state)
            ck.save(root, state, global_step=step)
    return Template(root, kept)


def _region(path: str, target: str) -> tuple[int, int]:
    """Bytes of ``target``'s file a flip may hit: all of it, or a safetensors file's header."""
    size = os.path.getsize(path)
    if target != "shard_header":
        return 0, size
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
    return 0, min(size, 8 + hlen)


@dataclasses.dataclass(frozen=True)
class Flip:
    index: int
    target: str
    rel: str
    pos: int
    bit: int

    def describe(self) -> str:
        return f"flip {self.index}: {self.rel} byte {self.pos} bit {self.bit}"


def draw_flips(step_dir: str, n: int, seed: int, start: int = 0) -> list[Flip]:
    """Flips ``start .. start+n-1``; flip ``i`` depends on ``(seed, i)`` and the files' sizes only."""
    regions = {t: _region(os.path.join(step_dir, rel), t) for t, rel in _STEP_FILES.items()}
    names, weights = [t for t, _ in TARGETS], [w for _, w in TARGETS]
    out = []
    for i in range(start, start + n):
        rng = random.Random(f"record-flips:{seed}:{i}")
        t = rng.choices(names, weights)[0]
        lo, hi = regions[t]
        out.append(Flip(i, t, _STEP_FILES[t], rng.randrange(lo, hi), rng.randrange(8)))
    return out


# -- one flip, in the child ---------------------------------------------------------------------

class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a message that cannot format is not evidence
            pass


_BAD_CAUSES = ("MemoryError", "RecursionError")


def _chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None and e not in out and len(out) < 50:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def classify_resume(template: Template) -> tuple[str, str]:
    """Resume ``template.root`` into fresh objects and classify the outcome (see the module doc)."""
    from refckpt import DistributedCheckpointer, get_training_state
    from refckpt.errors import CheckpointError

    model, opt = _model_and_optimizer(99)
    state = get_training_state(model, opt, {})
    logger, handler = logging.getLogger("refckpt"), _Messages()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    error: BaseException | None = None
    path = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                path = DistributedCheckpointer().load_latest(template.root, state)
            except BaseException as e:  # noqa: BLE001 - classified below
                error = e
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    said = [str(w.message) for w in caught] + handler.messages
    bad = [c for c in _BAD_CAUSES if any(c in m for m in said)]
    if error is not None:
        chain = _chain(error)
        bad += [type(x).__name__ for x in chain if isinstance(x, (MemoryError, RecursionError))]
        if bad:
            return "other", f"{sorted(set(bad))[0]} behind {type(error).__name__}: {str(error)[:160]}"
        if isinstance(error, CheckpointError):
            return "clear_error", f"{type(error).__name__}: {str(error)[:160]}"
        return "other", f"not a CheckpointError: {type(error).__name__}: {str(error)[:160]}"
    if bad:
        return "other", f"{bad[0]} inside the library (it went on: loaded {path})"
    if path is None:
        return "other", "load_latest found no checkpoint (step 1 was intact)"
    step = int(os.path.basename(path).rsplit("_", 1)[1])
    diff = _differences(_flatten(state), template.kept[step])
    if diff:
        return "other", f"silent difference: loaded {os.path.basename(path)}, {len(diff)} values differ ({', '.join(diff[:3])})"
    return ("identical" if step == 2 else "fallback"), os.path.basename(path)


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _restore(template: Template, originals: dict[str, bytes]) -> None:
    for rel, data in originals.items():
        _write(os.path.join(template.newest, rel), data)


def _apply(template: Template, originals: dict[str, bytes], flip: Flip) -> None:
    data = bytearray(originals[flip.rel])
    data[flip.pos] ^= 1 << flip.bit
    _write(os.path.join(template.newest, flip.rel), bytes(data))


def _limit_address_space() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = vm + ADDRESS_SPACE_MARGIN
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def _child(template: Template, originals: dict[str, bytes], flips: list[Flip], out_fd: int) -> None:  # pragma: no cover
    """Runs in the forked child: each flip applied, resumed, classified, restored; one JSON line
    per flip to ``out_fd``."""
    _limit_address_space()
    for flip in flips:
        _apply(template, originals, flip)
        try:
            cls, detail = classify_resume(template)
        except BaseException as e:  # noqa: BLE001 - the classifier itself failed: not a pass
            cls, detail = "other", f"classifier failed: {type(e).__name__}: {e} {traceback.format_exc()[-300:]}"
        _restore(template, originals)
        line = (json.dumps({"i": flip.index, "cls": cls, "detail": detail}) + "\n").encode()
        while line:
            line = line[os.write(out_fd, line):]


# -- the survey ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Survey:
    seed: int
    results: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    flips: dict[int, Flip] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    library: str = ""

    def counts(self) -> collections.Counter:
        return collections.Counter(cls for cls, _ in self.results.values())

    def others(self) -> list[tuple[Flip, str]]:
        return [(self.flips[i], d) for i, (cls, d) in sorted(self.results.items()) if cls == "other"]

    def table(self, show: int = 12) -> str:
        by = collections.Counter((self.flips[i].target, cls) for i, (cls, _) in self.results.items())
        targets = [t for t, _ in TARGETS]
        lines = [f"record flips: {len(self.results)} single-bit flips (seed {self.seed}) in {self.seconds:.1f} s, "
                 f"refckpt from {self.library}",
                 "",
                 "| outcome | " + " | ".join(_STEP_FILES[t] + (" (header)" if t == "shard_header" else "") for t in targets)
                 + " | total |",
                 "|---|" + "---|" * (len(targets) + 1)]
        for cls in CLASSES:
            row = [by.get((t, cls), 0) for t in targets]
            lines.append(f"| {cls} | {' | '.join(str(x) for x in row)} | {sum(row)} |")
        others = self.others()
        if others:
            causes = collections.Counter(_cause(d) for _, d in others)
            lines += ["", "other, by cause: " + ", ".join(f"{c}: {n}" for c, n in causes.most_common())]
            lines += [f"  {f.describe()}: {d}" for f, d in others[:show]]
            if len(others) > show:
                lines.append(f"  ... and {len(others) - show} more")
        return "\n".join(lines)


def _cause(detail: str) -> str:
    for key in ("silent difference", "MemoryError", "RecursionError", "timeout", "crashed", "found no checkpoint",
                "not a CheckpointError", "classifier failed"):
        if key in detail:
            return key
    return detail.split(":", 1)[0]


class _Lane:
    """A root of its own and the flips still to run in it; a forked child runs them in order.
    A child that hangs past the per-flip limit is SIGKILLed, one that dies is reaped; either
    way the flip it was on is ``other`` and a new child takes the rest."""

    def __init__(self, template: Template, flips: list[Flip], timeout: float) -> None:
        self.template = template
        self.originals = {rel: open(os.path.join(template.newest, rel), "rb").read() for rel in _STEP_FILES.values()}
        self.todo = collections.deque(flips)
        self.timeout = timeout
        self.pid = 0
        self.fd = -1
        self.buf = b""
        self.deadline = 0.0

    def start(self) -> None:
        _restore(self.template, self.originals)  # a killed child may have left a flip behind
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            code = 0
            try:
                gc.freeze()  # see faults.suite._common.in_child
                os.close(r)
                _child(self.template, self.originals, list(self.todo), w)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self.pid, self.fd, self.buf = pid, r, b""
        self.deadline = time.monotonic() + self.timeout

    def _end_child(self, kill: bool) -> int:
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = os.waitpid(self.pid, 0)[1]
        os.close(self.fd)
        self.fd = -1
        return os.waitstatus_to_exitcode(status)

    def read(self, results: dict[int, tuple[str, str]]) -> None:
        chunk = os.read(self.fd, 1 << 16)
        if chunk:
            self.buf += chunk
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                rec = json.loads(line)
                assert self.todo and self.todo[0].index == rec["i"], (rec, list(self.todo)[:1])
                self.todo.popleft()
                results[rec["i"]] = (rec["cls"], rec["detail"])
                self.deadline = time.monotonic() + self.timeout
            return
        code = self._end_child(kill=False)
        if self.todo:
            flip = self.todo.popleft()
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            results[flip.index] = ("other", f"the resume crashed the process ({how})")
            self.start()

    def expire(self, results: dict[int, tuple[str, str]]) -> None:
        self._end_child(kill=True)
        flip = self.todo.popleft()
        results[flip.index] = ("other", f"timeout: no result within {self.timeout:.0f} s (hung)")
        if self.todo:
            self.start()


def survey(n: int = DEFAULT_FLIPS, seed: int = 0, *, jobs: int = 1, timeout: float = FLIP_TIMEOUT) -> Survey:
    """Run ``n`` seeded flips (``jobs`` children at once, each in its own copy of the checkpoint)
    and return the classified outcomes.

    The checkpoint is saved under ``tempfile.mkdtemp(prefix="record-flips-")``, whose name has
    the same length on every run: the commit record holds the path it was staged at, so the
    record's size -- and with it where flip ``i`` lands -- is the same for the test, the command
    and any refckpt version that writes the same record layout."""
    import refckpt

    workdir = tempfile.mkdtemp(prefix="record-flips-")
    t0 = time.monotonic()
    try:
        template = build_checkpoint(os.path.join(workdir, "template"))
        flips = draw_flips(template.newest, n, seed)
        out = Survey(seed, flips={f.index: f for f in flips}, library=os.path.dirname(refckpt.__file__))
        jobs = max(1, min(jobs, n))
        lanes = []
        for j in range(jobs):
            root = os.path.join(workdir, f"lane{j}")
            shutil.copytree(template.root, root)
            lanes.append(_Lane(Template(root, template.kept), flips[j::jobs], timeout))
        for lane in lanes:
            if lane.todo:
                lane.start()
        while any(lane.todo for lane in lanes):
            live = [lane for lane in lanes if lane.todo]
            wait = max(0.0, min(lane.deadline for lane in live) - time.monotonic())
            ready, _, _ = select.select([lane.fd for lane in live], [], [], wait)
            for lane in live:
                if lane.fd in ready:
                    lane.read(out.results)
            now = time.monotonic()
            for lane in live:
                if lane.todo and lane.fd not in ready and now >= lane.deadline:
                    lane.expire(out.results)
        for lane in lanes:  # reap children that finished their last flip
            if lane.fd >= 0:
                while os.read(lane.fd, 1 << 16):
                    pass
                lane._end_child(kill=False)
        out.seconds = time.monotonic() - t0
        return out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- the test -----------------------------------------------------------------------------------

def test_single_bit_flips_never_load_silently_wrong_hang_or_crash(request):
    """Seeded single-bit flips in the newest step's commit record, extra state and shard
    header: every resume is ``identical``, ``fallback`` or ``clear_error`` -- never ``other``.
    ``--record-flips N`` sets the count (default 120), ``--record-flips-seed S`` the draw."""
    n = request.config.getoption("--record-flips", default=None) or DEFAULT_FLIPS
    seed = request.config.getoption("--record-flips-seed", default=None) or 0
    result = survey(n, seed)
    table = result.table(show=40)
    print("\n" + table)
    assert len(result.results) == n, table
    others = result.others()
    assert not others, f"{len(others)} of {n} flips ended neither bitwise right nor in a clear error:\n{table}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.test_record_flips", description=__doc__.split("\n\n")[0])
    p.add_argument("flips", type=int, nargs="?", default=DEFAULT_FLIPS, help="number of flips (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which flips (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="children at once, each in its own copy (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=FLIP_TIMEOUT, help="seconds per flip (default: %(default)s)")
    p.add_argument("--show", type=int, default=40, help="how many 'other' flips to list (default: %(default)s)")
    args = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = survey(args.flips, args.seed, jobs=args.jobs, timeout=args.timeout)
    print(result.table(show=args.show))
    return 1 if result.others() else 0


if __name__ == "__main__":
    raise SystemExit(main())
