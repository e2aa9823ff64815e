"""The power-loss explorer (faults.crashsim, faults.powerloss): its persistence model on
hand-made traces, the strace parser on a real strace, and bounded explorations: refckpt at 1
and 2 ranks survives every state; the three known-bad protocols and plain DCP are caught with
a counterexample. The full exploration is ``python -m faults powerloss`` (README)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from faults import crashsim as C
from faults import powerloss as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


def _states(root, trace):
    model = C.Model(root)
    iops = model.replay(trace)
    return model, iops, C.crash_states(trace, iops, budget=10_000)


def _tree(model, iops, cs, dest):
    entries, content = C.build_state(model, iops, cs)
    model.materialise(entries, content, dest)
    out = {}
    for dirpath, _dirs, files in os.walk(dest):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), dest)] = fh.read()
    return out


def test_new_entries_need_a_directory_fsync_and_data_a_file_fsync(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "old").write_bytes(b"old")
    r = str(root)
    trace = [C.FOp(1, "open", f"{r}/new", fd=1, create=True, trunc=True),
             C.FOp(2, "write", f"{r}/new", fd=1, offset=0, data=b"hello"),
             C.FOp(3, "fsync", f"{r}/new", fd=1)]
    model, iops, states = _states(r, trace)
    end = [s for s in states if s.point == len(trace)]
    trees = [_tree(model, iops, s, str(tmp_path / f"s{i}")) for i, s in enumerate(end)]
    # file fsynced but its directory not: a state without the new entry must exist
    assert any("new" not in t for t in trees)
    assert all(t["old"] == b"old" for t in trees)  # what was durable before stays
    trace.append(C.FOp(4, "fsync_dir", r))
    model, iops, states = _states(r, trace)
    end = [s for s in states if s.point == len(trace)]
    trees = [_tree(model, iops, s, str(tmp_path / f"t{i}")) for i, s in enumerate(end)]
    assert trees and all(t.get("new") == b"hello" for t in trees), "after fsync(file) and fsync(dir) nothing may be lost"


def test_rename_without_data_fsync_can_leave_an_empty_file(tmp_path):
    """The classic: write tmp, rename over the target, fsync the directory -- but never fsync tmp."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "ptr").write_bytes(b"1\n")
    r = str(root)
    trace = [C.FOp(1, "open", f"{r}/tmp", fd=1, create=True, trunc=True),
             C.FOp(2, "write", f"{r}/tmp", fd=1, offset=0, data=b"22\n"),
             C.FOp(3, "rename", f"{r}/tmp", f"{r}/ptr"),
             C.FOp(4, "fsync_dir", r)]
    model, iops, states = _states(r, trace)
    final = {_tree(model, iops, s, str(tmp_path / f"s{i}")).get("ptr") for i, s in enumerate(states) if s.point == len(trace)}
    assert b"" in final, "the rename may persist without the data"
    assert b"22\n" in final
    kinds = {s.kind for s in states}
    assert {"prefix", "dropped", "reordered"} <= kinds


def test_torn_write_keeps_a_sector_prefix_and_zeros(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    r = str(root)
    data = bytes(range(256)) * 20  # 5120 bytes
    trace = [C.FOp(1, "open", f"{r}/f", fd=1, create=True, trunc=True), C.FOp(2, "write", f"{r}/f", fd=1, data=data),
             C.FOp(3, "fsync_dir", r)]
    model, iops, states = _states(r, trace)
    torn = [s for s in states if s.kind == "torn"]
    assert {s.torn[1] for s in torn} == {512, 2560, 4096}
    for s in torn:
        got = _tree(model, iops, s, str(tmp_path / f"t{s.torn[1]}_{s.point}"))["f"]
        n = s.torn[1]
        assert got[:n] == data[:n] and got[n:] == bytes(len(data) - n)


@needs_strace
def test_strace_recorder_sees_a_real_save_protocol(tmp_path):
    script = (
        "import os, sys\n"
        "d = sys.argv[1]\n"
        "os.makedirs(os.path.join(d, 'sub'))\n"
        "with open(os.path.join(d, 'sub', 'x.tmp'), 'wb') as f:\n"
        "    f.write(b'abc'); f.write(b'def'); f.flush(); os.fsync(f.fileno())\n"
        "os.replace(os.path.join(d, 'sub', 'x.tmp'), os.path.join(d, 'sub', 'x'))\n"
        "fd = os.open(os.path.join(d, 'sub'), os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)\n"
        "os.unlink(os.path.join(d, 'sub', 'x'))\n"
    )
    d = str(tmp_path / "d")
    os.makedirs(d)
    ops = C.strace_record([sys.executable, "-c", script, d])
    mine = [op for op in ops if op.path.startswith(d) or op.path2.startswith(d)]
    kinds = [op.kind for op in mine]
    assert kinds[0] == "mkdir" and mine[0].path == os.path.join(d, "sub")
    writes = [op for op in ops if op.kind == "write" and op.path.endswith("x.tmp")]
    assert [(w.offset, w.data) for w in writes] == [(0, b"abc"), (3, b"def")] or \
        [(w.offset, w.data) for w in writes] == [(0, b"abcdef")]
    assert ("rename", os.path.join(d, "sub", "x.tmp"), os.path.join(d, "sub", "x")) in [(o.kind, o.path, o.path2) for o in mine]
    assert "unlink" in kinds and kinds.index("rename") < kinds.index("unlink")
    fsyncs = [op.path for op in ops if op.kind == "fsync"]
    assert os.path.join(d, "sub", "x.tmp") in fsyncs and os.path.join(d, "sub") in fsyncs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_refckpt_survives_every_power_loss_state(world_size):
    rep = P.explore_refckpt(world_size, budget=120 if world_size == 1 else 80)
    assert rep.ok, "\n".join(rep.failures[:5])
    assert rep.states["prefix"] and rep.states["dropped"] and rep.states["reordered"] and rep.states["torn"]
    assert rep.acked_lost == 0 and rep.landed.get("step 10") and rep.landed.get("step 9")
    assert rep.ops["fsync_dir"] >= 3 and rep.ops["rename"] >= 2


@pytest.mark.extended
@pytest.mark.slow
@needs_strace
@pytest.mark.parametrize("mutant,expected", [
    ("no_dir_fsync", "step 10 was guaranteed"),
    ("pointer_in_place", "names no complete step"),
    ("pointer_before_commit", "names no complete step"),
])
def test_known_bad_protocols_are_caught_with_a_counterexample(mutant, expected):
    rep = P.explore_traced(f"tests.mutants:{mutant}", budget=40, cwd=ROOT)
    assert not rep.ok, f"{mutant} survived {sum(rep.states.values())} crash states"
    assert any(expected in f for f in rep.failures), rep.failures[:3]


@pytest.mark.extended
@pytest.mark.slow
@needs_strace
def test_plain_dcp_loses_an_acknowledged_save_to_power_loss():
    """Plain DCP never fsyncs a directory: right after ``dcp.save`` returns, a power cut can
    take the new checkpoint's ``.metadata`` (or the whole directory) away."""
    rep = P.explore_traced(P.TARGETS["dcp"], name="dcp", budget=40, cwd=ROOT)
    assert rep.acked_lost > 0, rep.row()


def test_powerloss_command_prints_the_table(capsys):
    from faults.__main__ import main

    assert main(["powerloss", "--targets", "refckpt", "--world-sizes", "1", "--budget", "40"]) == 0
    out = capsys.readouterr().out
    assert P.HEADER.splitlines()[0] in out
    assert "| refckpt | 1 |" in out and "| 0 | 0 |" in out


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_an_fsync_before_the_buffer_reaches_the_kernel_is_not_durable(tmp_path, buffered):
    """A file written through a user-space buffer and fsynced before the buffer was flushed: the
    fsync covered only what the kernel held (issue 29's surviving mutant: ``open_write`` made
    buffered passed the power-loss checks, which counted the fsync call, not the bytes)."""
    root = tmp_path / "root"
    root.mkdir()
    before = C.snapshot_tree(str(root))
    step = root / "global_step_1"
    with C.record() as trace:
        os.mkdir(step)
        with open(step / "shard", "wb", buffering=-1 if buffered else 0) as f:
            f.write(b"x" * 1000)  # in the buffer, when buffered (8 KiB)
            os.fsync(f.fileno())
        for d in (step, root):
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    lost = C.acknowledged_not_durable(before, trace, str(root), str(step))
    if buffered:
        assert lost == ["global_step_1/shard: data not durable: 1000 of its 1000 bytes reached the kernel after its "
                        "last fsync (written through a buffer the fsync did not flush)"]
    else:
        assert lost == []
