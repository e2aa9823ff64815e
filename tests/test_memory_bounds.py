"""Memory while reading checkpoint bytes is bounded by the bytes read, for every reader.

Parsing a pickle of ``n`` bytes -- the commit record, a torch.save file's ``data.pkl`` -- may allocate
at most ``ALLOC_FACTOR * n + ALLOC_BASE`` bytes (:func:`refckpt.record.scan_pickle`), and a torch.save
file's members are read as stored, never inflated (:func:`refckpt.safeload.check_torch_save`). Each
attack runs in a forked child whose address space is limited to its current size + that bound for the
file + ``SLACK`` (the reader's own working set: a load of the older step beside it), through the real
entry points -- ``find_latest_checkpoint``, ``DistributedCheckpointer().load_latest``, ``refckpt ls``
and ``refckpt verify`` -- and must end in a :class:`~refckpt.errors.CheckpointError` (a fall-back to the
older, good step), never a MemoryError or a dead child, with the child's peak resident growth
(less the pages of its own code, :func:`_growth`) within the bound. Attacks the scan accepts (their
parse stays within the bound) are parsed, and their measured peak is checked against the scan's
estimate and the bound. The hostile files come from ``tests/_bombs.py``.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import resource
import traceback
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import refckpt
from refckpt import DistributedCheckpointer, check_step_dir, find_latest_checkpoint
from refckpt import errors as E
from refckpt.layout import METADATA_FILE
from refckpt.record import (
    ALLOC_BASE,
    ALLOC_FACTOR,
    RECORD_READER,
    TORCH_READER,
    FileRecord,
    Manifest,
    encode_record,
    scan_pickle,
    tensor_summary,
)
from refckpt.safeload import load_record, safe_torch_load
from refckpt.tools.cli import main as cli_main

from . import _bombs as X
from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

MiB = 1 << 20
#: Address space the child may use beyond the bound: the loads of the good steps (DCP's machinery,
#: a thread pool's stacks and malloc arenas are virtual memory too) and page/arena rounding.
SLACK = 256 * MiB


def bound(size: int) -> int:
    return ALLOC_FACTOR * size + ALLOC_BASE


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _mapped_files() -> int:
    """Resident pages of mapped files: on disk (RssFile) or on tmpfs (RssShmem: a venv in /tmp)."""
    return _status("RssFile") + _status("RssShmem")


def _start() -> tuple[int, int]:
    """Reset the peak resident size (VmHWM) to the current one; (resident size, mapped files' part)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS"), _mapped_files()


def _growth(start: tuple[int, int]) -> int:
    """The peak resident growth since ``start``, less the growth of mapped files' pages.

    Those are the program's own code: fork does not copy the page tables of file mappings, so every
    library function the child runs for the first time faults its pages in -- 0.4 MiB for a
    ``Parameter``'s first unpickling on disk, 4 MiB from a tmpfs with huge pages. They are
    not memory the reader allocated; subtracting their growth at the end can understate the
    allocations by code first run after the peak (error paths: a few pages), never overstate them.
    Memory freed while code pages grew can make the difference negative: that is no growth, 0.
    """
    rss, file = start
    return max(0, _status("VmHWM") - rss - max(0, _mapped_files() - file))


def _in_child(fn, limit: int, timeout: float = 120):
    """``fn()`` in a forked child under RLIMIT_AS = its size + ``limit``: (ok, result or error text,
    peak resident growth in bytes while ``fn`` ran, as :func:`_growth`); (False, "died ...", -1)
    when the child died."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def body():
        import faulthandler
        import gc
        import sys

        # the parent's objects are never collected here: a finalizer of the parent's (a tensor, a
        # thread's queue) may need a lock that one of its threads held at the fork, and a full
        # collection of a long-lived xdist worker's heap is not what the child measures. A child
        # hung 120 s inside a collection after the scan re-enabled the collector (2026-12-07).
        gc.freeze()
        # a child that hangs says where, in the test's captured output, before the parent kills it
        faulthandler.dump_traceback_later(max(1.0, timeout - 5), file=sys.__stderr__)
        vm = _status("VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (vm + limit, vm + limit))
        start = _start()
        try:
            out = (True, fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = (False, f"{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        child.send((*out, _growth(start)))

    p = ctx.Process(target=body)
    p.start()
    child.close()
    try:
        if not parent.poll(timeout):
            p.kill()
            raise AssertionError(f"the child took more than {timeout} s")
        return parent.recv()
    except EOFError:
        return False, f"died (exit code {p.exitcode})", -1
    finally:
        p.join(10)


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(argv))
    return rc, out.getvalue() + err.getvalue()


def _resume(root: str, params: dict, kind: str = "adamw") -> str | None:
    """``load_latest`` into a fresh model; the parameters it restored must be ``params`` bitwise."""
    model, opt, state = B.fresh_state(kind=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = DistributedCheckpointer().load_latest(root, state)
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), params)
    return got


# -- the commit record -------------------------------------------------------------------------
#: Refused by the scan (estimate over the bound): attack -> file size.
REFUSED = {"empty_set": 2 * MiB, "empty_dict": MiB, "empty_list": MiB, "frozenset": MiB, "build_reuse": MiB,
           "set_reuse": MiB, "frozenset_reuse": MiB, "odict_reuse": MiB, "size_reuse": MiB, "mdindex_reuse": MiB,
           "path_split": MiB, "path_nested": MiB}
#: Within the bound: parsed (and then refused as not a DCP Metadata).
ACCEPTED = ["tuple", "short_str", "astral_str", "binint", "float", "long", "get", "dup", "memoize", "sparse_memo",
            "appends_get", "setitems_get", "additems"]


def test_every_record_attack_is_classified():
    assert set(REFUSED) | set(ACCEPTED) == set(X.RECORD_BOMBS)


def _peak(fn):
    """(``fn()``, the growth of the resident size's peak while it ran, as :func:`_growth`)."""
    start = _start()
    out = fn()
    return out, _growth(start)


def _record_entry_points(root: str, step_dir: str, older: str, params: dict) -> dict:
    """Every reader of the root; the peaks of those that read only the records (no load)."""
    st, peak_check = _peak(lambda: check_step_dir(step_dir, root))
    latest, peak_find = _peak(lambda: find_latest_checkpoint(root))
    (rc, text), peak_ls = _peak(lambda: _cli("ls", root))
    return {"find_latest": latest, "complete": st.complete, "reason": st.reason,
            "load_latest": _resume(root, params), "ls": (rc, text), "peak": max(peak_check, peak_find, peak_ls)}


@pytest.mark.parametrize("kind,footer", [(k, False) for k in sorted(REFUSED)] + [("empty_set", True)],
                         ids=[f"{k}-no_footer" for k in sorted(REFUSED)] + ["empty_set-valid_footer"])
def test_a_record_bomb_is_refused_before_it_allocates(ckpt, template, kind, footer):
    """Through find_latest_checkpoint, load_latest and ``refckpt ls``: the newest step is refused
    (corrupt, "cannot parse ... could allocate without bound"), resume lands on the older step bitwise, and the child's peak
    stays within the bound of the record's size. Before the scan bounded allocations, 2 MiB of
    EMPTY_SET took 480 MiB here (MemoryError under the limit; 8 MiB took 1.9 GiB). The footer variant
    (a record whose own checksum holds: a forger's) runs for the issue's attack only."""
    root, s4, s42 = ckpt
    body = X.bomb_record(kind, REFUSED[kind])
    data = encode_record(body) if footer else body
    with open(os.path.join(s42, METADATA_FILE), "wb") as f:
        f.write(data)
    with pytest.raises(E.CorruptCheckpointError, match="cannot parse the commit record"):
        scan_pickle(body, "x")

    ok, out, peak = _in_child(lambda: _record_entry_points(root, s42, s4, template[1][4]), bound(len(data)) + SLACK)
    assert ok, out
    assert out["find_latest"] == s4 and out["load_latest"] == s4
    assert not out["complete"] and "cannot parse the commit record" in out["reason"], out["reason"]
    assert "could allocate without bound" in out["reason"] and "MemoryError" not in out["reason"], out["reason"]
    assert s42 in out["reason"]
    rc, text = out["ls"]
    assert rc == 0 and "global_step_42" in text and "could allocate without bound" in text, text
    assert out["peak"] <= bound(len(data)) + 4 * MiB, f"peak {out['peak']} over the bound {bound(len(data))}"
    assert peak >= 0


@pytest.mark.parametrize("kind", ACCEPTED)
def test_a_record_within_the_bound_is_parsed_within_it(ckpt, template, kind):
    """The scan accepts these (their estimate is within the bound): the C unpickler's measured peak
    stays within the estimate and the bound, and the record is then refused for what it holds."""
    root, s4, s42 = ckpt
    body = X.bomb_record(kind, MiB // 2)
    est = scan_pickle(body, "x")
    assert est <= bound(len(body))
    path = os.path.join(s42, METADATA_FILE)
    with open(path, "wb") as f:
        f.write(body)

    def parse():
        with pytest.raises(E.CorruptCheckpointError, match="not DCP Metadata"):
            load_record(path)

    ok, out, peak = _in_child(parse, bound(len(body)) + SLACK)
    assert ok, out
    assert peak <= est + MiB, f"{kind}: measured peak {peak} over the estimate {est}"
    assert peak <= bound(len(body))
    ok, out, _ = _in_child(lambda: _record_entry_points(root, s42, s4, template[1][4]), bound(len(body)) + SLACK)
    assert ok, out
    assert out["find_latest"] == s4 and out["load_latest"] == s4 and not out["complete"]


def _sharded_record(world: int, tensors: int, *, refckpt_writer: bool = True) -> bytes:
    """The commit record ``world`` ranks write for ``tensors`` tensors sharded along dim 0 (FSDP2's
    layout, uneven and empty chunks included) and a byte item: refckpt's (manifest, footer, the
    highest protocol) or plain DCP's (protocol 4, a pathlib checkpoint id, no manifest)."""
    import pathlib

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict = {}
    storage: dict = {}
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    pos = [0] * world

    def put(r: int, idx, length: int) -> None:
        storage[idx] = _StorageInfo(f"__{r}_0.distcp", pos[r], length)
        blocks[r].append((pos[r], length, (pos[r] * 2654435761) & 0xFFFFFFFF))
        pos[r] += length

    for t in range(tensors):
        fqn = f"model.layers.{t // 9}.block_{t % 9}.weight" if t % 3 else f"optimizer.state.layers.{t}.exp_avg"
        rows, cols = 7 + t % 13, 16
        per = -(-rows // world)
        chunks = []
        for r in range(world):
            start = min(rows, r * per)
            n = max(0, min(rows, start + per) - start)
            offsets, sizes = torch.Size([start if n else rows, 0]), torch.Size([n, cols])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            put(r, MetadataIndex(fqn, offsets), n * cols * 4)
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, cols]), chunks)
    sdm["optimizer.param_groups.0.lr"] = BytesStorageMetadata()
    put(0, MetadataIndex("optimizer.param_groups.0.lr"), 700)
    if not refckpt_writer:
        md = Metadata(state_dict_metadata=sdm, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=pathlib.PosixPath("/ckpt/global_step_7")))
        return pickle.dumps(md, protocol=4)
    md = Metadata(state_dict_metadata=sdm, storage_data=storage, storage_meta=StorageMeta(checkpoint_id="/ckpt/step"))
    files = {f"__{r}_0.distcp": FileRecord(f"__{r}_0.distcp", pos[r], tuple(blocks[r])) for r in range(world)}
    Manifest(files=files, checksum="crc32c", tensors=tensor_summary(md),
             info={"world_size": world, "global_step": 7, "extra_state": "per_rank", "writer": "0" * 16}).attach(md)
    return encode_record(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


#: real records: (world size, tensors, refckpt's writer).
LEGIT = [(1, 9, True), (2, 30, True), (8, 300, True), (4, 2000, True), (1, 300, False), (8, 500, False)]


@pytest.mark.parametrize("world,tensors,refckpt_writer", LEGIT)
def test_real_records_pass_with_margin_and_parse_within_the_estimate(world, tensors, refckpt_writer):
    data = _sharded_record(world, tensors, refckpt_writer=refckpt_writer)
    body = data[:-56] if refckpt_writer else data
    est = scan_pickle(body, "x")
    assert est <= 0.85 * bound(len(body)), f"{est / len(body):.1f} x the record's size: too close to {ALLOC_FACTOR}"

    def parse():
        from refckpt.record import unpickle_record
        from refckpt.safeload import MetadataUnpickler

        md = unpickle_record(body, "x", MetadataUnpickler)
        return len(md.state_dict_metadata)

    ok, out, peak = _in_child(parse, bound(len(body)) + SLACK)
    assert ok and out == tensors + 1, out
    assert peak <= est + MiB, f"measured {peak}, estimated {est}"


def test_the_fixtures_records_pass(ckpt):
    """What refckpt's save wrote: read, scanned and parsed as every reader does."""
    root, s4, s42 = ckpt
    for step in (s4, s42):
        body = open(os.path.join(step, METADATA_FILE), "rb").read()[:-56]
        assert scan_pickle(body, step) <= 0.85 * bound(len(body))
        assert load_record(os.path.join(step, METADATA_FILE))[1] == "sha256"
    assert find_latest_checkpoint(root) == s42


def test_a_container_changed_after_a_tuple_took_it_and_an_empty_memo_slot_are_refused():
    grown = b"\x80\x04]\x94\x85\x940h\x00(NNNe."  # a list put in a tuple, then appended to: its weight was taken
    with pytest.raises(E.CorruptCheckpointError, match="x.pt: cannot parse .*changed after"):
        scan_pickle(grown, "x.pt")
    with pytest.raises(E.CorruptCheckpointError, match="slot 7, which holds nothing"):
        scan_pickle(b"\x80\x04N\x94h\x07.", "x.pt")
    assert scan_pickle(b"\x80\x04]\x94(NNNe\x85.", "x") > 0  # filled, then put in a tuple: fine


def test_calls_and_builds_torch_save_never_writes_are_refused():
    """torch's unpickler calls ``func(*args)`` with whatever ``args`` holds and BUILDs a tensor with
    ``set_(*state)``: both copy what a list references, which the scan does not weigh; torch.save
    writes neither, so both are refused."""
    with pytest.raises(E.CorruptCheckpointError, match="arguments are a list"):
        scan_pickle(b"\x80\x02ctorch\nSize\n](K\x01K\x02eR.", "x.pt", TORCH_READER)
    with pytest.raises(E.CorruptCheckpointError, match="a BUILD of a tensor"):
        scan_pickle(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n)R(K\x01K\x02tb.", "x.pt", TORCH_READER)
    with pytest.raises(E.CorruptCheckpointError, match="state is a list"):
        scan_pickle(b"\x80\x02ccollections\nOrderedDict\n)R](K\x01K\x02\x86eb.", "x.pt", TORCH_READER)


def test_the_pointer_is_read_64_bytes_at_most(ckpt):
    """A pointer file of 1 GiB (sparse) costs nothing: the reader takes 64 bytes of it."""
    root, _s4, s42 = ckpt
    with open(os.path.join(root, "latest_checkpoint_iteration.txt"), "wb") as f:
        f.truncate(1 << 30)

    ok, out, peak = _in_child(lambda: (find_latest_checkpoint(root), _cli("ls", root)[0]), SLACK)
    assert ok and out == (s42, 0), out
    assert peak < 16 * MiB


# -- torch.save files: extra state, non-tensor items ----------------------------------------------
@pytest.fixture(scope="module")
def family_template(tmp_path_factory):
    """A root with a refckpt step 3 and, newest, a plain-DCP step 5 (``dcp.save`` with a
    ``FileSystemWriter``, no process group) with its extra state in ``extra_state/extra_state_rank_0.pt``,
    as the VeOmni / hyper_parallel family writes it; and the parameters of step 3."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = tmp_path_factory.mktemp("family") / "root"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _older, params, _o = B.save_trained(root, 3, seed=1)
        model, opt = B.make(5, "adamw")
        B.train(model, opt, range(5))
        msd, osd = get_state_dict(model, opt)
        step_dir = os.path.join(root, "global_step_5")
        dcp.save({"model": msd, "optimizer": osd}, storage_writer=FileSystemWriter(step_dir), no_dist=True)
    os.makedirs(os.path.join(step_dir, "extra_state"))
    torch.save({"global_step": 5}, os.path.join(step_dir, B.EXTRA_REL))
    return str(root), params


@pytest.fixture
def family(family_template, tmp_path):
    import shutil

    root = tmp_path / "root"
    shutil.copytree(family_template[0], root)
    return str(root), str(root / "global_step_3"), str(root / "global_step_5"), family_template[1]


@pytest.fixture(scope="module")
def deflated():
    """About 2 MiB of extra state whose storage member inflates to 512 MiB (built from one compressed
    block repeated: fast)."""
    from faults.hostile import deflated_torch_save

    return deflated_torch_save(512 * MiB)


def _extra_entry_points(root: str, step_dir: str, params: dict) -> dict:
    model, opt, state = B.fresh_state()
    try:
        DistributedCheckpointer().load(step_dir, state)
        direct = "loaded"
    except E.CheckpointError as e:
        direct = f"{type(e).__name__}: {e}"
    rc, text = _cli("verify", step_dir)
    return {"load": direct, "load_latest": _resume(root, params), "verify": (rc, text)}


def test_deflated_extra_state_fails_without_inflating(family, deflated):
    """Plain DCP keeps no checksums, so only the read can judge the extra-state file: its DEFLATE
    members are refused from the zip's central directory, nothing is inflated, and resume falls
    back to step 3. torch.load would inflate 512 MiB (1.3 GiB peak)."""
    root, s3, s5, params = family
    path = os.path.join(s5, B.EXTRA_REL)
    with open(path, "wb") as f:
        f.write(deflated)
    assert len(deflated) < 3 * MiB  # 512 MiB inflated

    ok, out, peak = _in_child(lambda: _extra_entry_points(root, s5, params), bound(len(deflated)) + SLACK)
    assert ok, out
    assert out["load"].startswith("CorruptCheckpointError") and path in out["load"], out["load"]
    assert "DEFLATE" in out["load"] and "inflate to 536870912" in out["load"], out["load"]
    assert out["load_latest"] == s3
    rc, text = out["verify"]
    assert rc != 0 and "DEFLATE" in text, text
    assert peak <= bound(len(deflated)) + 64 * MiB, f"peak {peak}"


@pytest.mark.parametrize("kind", sorted(X.TORCH_BOMBS))
def test_a_torch_pickle_bomb_in_extra_state_is_refused(family, kind):
    root, s3, s5, params = family
    data = X.torch_bomb(kind, MiB)
    path = os.path.join(s5, B.EXTRA_REL)
    with open(path, "wb") as f:
        f.write(data)

    ok, out, peak = _in_child(lambda: _extra_entry_points(root, s5, params), bound(len(data)) + SLACK)
    assert ok, out
    assert out["load"].startswith("CorruptCheckpointError") and path in out["load"], out["load"]
    assert "cannot parse the torch.save pickle" in out["load"], out["load"]
    assert out["load_latest"] == s3
    assert out["verify"][0] != 0
    assert peak <= bound(len(data)) + 64 * MiB, f"peak {peak}"


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _legit_torch_objects() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(200)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {
        "extra_state": {"global_step": 1000, "rng": torch.get_rng_state(), "loader": {"epoch": 3, "pos": 12345}},
        "loader_position": {"indices": list(range(3000)), "name": "é" * 300, "lr": [0.1] * 100},
        "containers": {"b": b"x" * 1000, "ba": bytearray(b"y" * 100), "s": set(range(200)), "c": complex(1, 2),
                       "size": torch.Size([3, 4]), "od": __import__("collections").OrderedDict(a=1),
                       "t": tuple((k, (k, str(k))) for k in range(500))},
        "state_dict": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scalars": {f"metric_{k}": torch.tensor(float(k)) for k in range(2000)},
        "parameter": torch.nn.Parameter(torch.ones(3)),
        "big_tensor": torch.arange(1 << 20, dtype=torch.float32),
    }


def test_legitimate_torch_save_files_load_with_margin():
    for name, obj in _legit_torch_objects().items():
        data = _saved(obj)
        pkl = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
        est = scan_pickle(pkl, name, TORCH_READER, size=len(data))
        assert est <= 0.85 * bound(len(data)), f"{name}: {est / len(data):.1f} x the file's size"
        back = safe_torch_load(data, name)
        if name == "containers":
            assert back == obj
        else:
            B.assert_bitwise(back, obj, name)

    files = {name: _saved(obj) for name, obj in _legit_torch_objects().items()}

    def load_all():  # no torch computation in the forked child: only reads
        safe_torch_load(files["extra_state"], "warm-up")  # the process's first torch.load (threads, caches)
        for name, data in files.items():
            _out, peak = _peak(lambda data=data, name=name: safe_torch_load(data, name))
            assert peak <= bound(len(data)), f"{name}: {peak} over {bound(len(data))}"
        return True

    ok, out, _ = _in_child(load_all, 4 * SLACK)
    assert ok, out


def _members_case(case: str) -> bytes:
    good = _saved({"global_step": 1, "t": torch.arange(16)})
    if case == "deflate":
        return X.rezip(good, zipfile.ZIP_DEFLATED)
    if case == "bzip2":
        return X.rezip(good, zipfile.ZIP_BZIP2)
    if case == "duplicate":  # torch's reader looks names up case-insensitively
        return X.rezip(good, extra=(("archive/DATA.PKL", b"\x80\x02N."),))
    if case == "overlap":
        first = zipfile.ZipFile(io.BytesIO(good)).getinfo("archive/data.pkl").header_offset
        return X.patch_central(good, "archive/byteorder", header_offset=first)
    if case == "sizes":
        size = zipfile.ZipFile(io.BytesIO(good)).getinfo("archive/data/0").file_size
        return X.patch_central(good, "archive/data/0", file_size=size + 4096)
    if case == "oversized":
        return X.patch_central(good, "archive/data/0", file_size=1 << 31, compress_size=1 << 31)
    raise AssertionError(case)


@pytest.mark.parametrize("case,why", [
    ("deflate", "are compressed, e.g."), ("bzip2", "BZIP2"), ("duplicate", "appears twice"),
    ("overlap", "overlaps|appears twice|no stored local header"), ("sizes", "declares"),
    ("oversized", "overlaps|damaged"),
])
def test_a_torch_save_zip_torch_never_writes_is_refused(case, why):
    data = _members_case(case)
    with pytest.raises(E.CorruptCheckpointError, match=f"^x.pt: .*({why})"):
        safe_torch_load(data, "x.pt")


def test_the_legacy_format_is_refused_with_the_fix_and_garbage_is_corrupt():
    legacy = io.BytesIO()
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(E.UnsafeCheckpointError, match="x.pt: refusing to unpickle .*re-save it with torch >= 1.6"):
        safe_torch_load(legacy.getvalue(), "x.pt")
    with pytest.raises(E.CorruptCheckpointError, match="x.pt: cannot read"):
        safe_torch_load(b"garbage!", "x.pt")


def test_the_readers_share_one_bound():
    """The commit record and a torch.save pickle are bounded by the same constants."""
    assert ALLOC_FACTOR == 32 and ALLOC_BASE == MiB
    assert RECORD_READER.name == "record" and TORCH_READER.name == "torch"
