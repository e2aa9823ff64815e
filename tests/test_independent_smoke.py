"""Single-process checks of the independent checkpointer and its mutants (no torch.distributed).

* The independent checkpointer round-trips bitwise and follows the reader rules.
* Every mutant still round-trips (they are subtle, not broken outright).
* Every mutant that a single process can expose is shown to be buggy by a small black-box
  probe that the unmutated checkpointer passes, so no mutant is accidentally correct.
  (``embedded_rank_variant_extra`` needs >= 2 ranks and is left to the multi-rank suite.)
Crashes are simulated by raising from one step of the protocol: what is on disk at that
moment is what a SIGKILL there would leave (process-crash model).
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.independent_ckpt import (
    POINTER,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    IndependentCheckpointer,
    make,
)
from tests.mutants import MUTANTS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class Crash(BaseException):
    """Stands in for SIGKILL at one protocol step (BaseException: no handler swallows it)."""


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    return model, opt


def train(model, opt, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(1000 + s)
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def state_of(model, opt, step: int) -> dict:
    ms, osd = get_state_dict(model, opt)
    return {"model": ms, "optimizer": osd, "extra_state": {"global_step": step, "pos": 10 * step, "rng": torch.arange(step + 3)}}


def snap(model, opt) -> dict[str, torch.Tensor]:
    """Clones of every parameter and optimizer state tensor (taken before the save: the oracle)."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"o.{n}.{k}"] = v.detach().clone()
    return out


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def resume(ck, path, *, unprimed: bool = False):
    model, opt = build(seed=99)
    st = state_of(model, opt, -1)
    if unprimed:  # an optimizer state dict before the first step: no per-parameter state yet
        model, opt = build(seed=99)
        st["optimizer"] = {"state": {}, "param_groups": st["optimizer"]["param_groups"]}
    st["extra_state"] = {}
    ck.load(path, st)
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optimizer"])
    return model, opt, st["extra_state"]


def save_steps(ck, root, steps, save_async=False):
    """Train and save each step; returns {step: oracle snapshot}."""
    model, opt = build()
    done, oracle = 0, {}
    for s in steps:
        train(model, opt, range(done + 1, s + 1))
        done = s
        oracle[s] = snap(model, opt)
        ck.save(root, state_of(model, opt, s), global_step=s, save_async=save_async)
        ck.maybe_wait_for_async_save()
    return oracle


def step_path(root, s):
    return os.path.join(str(root), f"global_step_{s}")


def distcp(root, s):
    return sorted(os.path.join(step_path(root, s), n) for n in os.listdir(step_path(root, s)) if n.endswith(".distcp"))


# -- the independent checkpointer -------------------------------------------------------------
@pytest.mark.parametrize("save_async", [False, True])
def test_round_trip_bitwise(tmp_path, save_async):
    ck = make()
    oracle = save_steps(ck, tmp_path, [2, 3], save_async=save_async)
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 3)
    assert (tmp_path / POINTER).read_text() == "3\n"
    assert sorted(os.listdir(step_path(tmp_path, 3))) == [".metadata", "__0_0.distcp", "extra_state"]
    model, opt, extra = resume(ck, step_path(tmp_path, 2))
    assert_bitwise(snap(model, opt), oracle[2])
    assert extra["global_step"] == 2 and extra["pos"] == 20 and torch.equal(extra["rng"], torch.arange(5))
    # training continued from the checkpoint equals the uninterrupted run
    train(model, opt, range(3, 4))
    assert_bitwise(snap(model, opt), oracle[3])


def test_unprimed_optimizer_gets_state(tmp_path):
    ck = make()
    oracle = save_steps(ck, tmp_path, [2])
    model, opt, _ = resume(ck, step_path(tmp_path, 2), unprimed=True)
    assert_bitwise(snap(model, opt), oracle[2])


def test_find_latest_ignores_pointer_and_incomplete_steps(tmp_path):
    ck = make()
    save_steps(ck, tmp_path, [1, 2])
    for garbage in ["", "2", "1\n", "9\n", "x\n", "-1\n", "../global_step_1\n"]:
        (tmp_path / POINTER).write_text(garbage)
        assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 2), garbage
    os.mkdir(step_path(tmp_path, 7))  # a newer step without a commit record
    (tmp_path / "global_step_07x").mkdir()
    (tmp_path / "global_step_6").write_bytes(b"not a dir")
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 2)
    for f in distcp(tmp_path, 2):  # truncated shard: step 2 no longer counts
        os.truncate(f, os.path.getsize(f) // 2)
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 1)
    os.remove(os.path.join(step_path(tmp_path, 1), "extra_state", "extra_state_rank_0.pt"))
    assert ck.find_latest_checkpoint(tmp_path) is None
    with pytest.raises(IncompleteCheckpointError):
        resume(ck, step_path(tmp_path, 1))


def test_bit_flip_is_detected(tmp_path):
    ck = make()
    save_steps(ck, tmp_path, [1])
    f = distcp(tmp_path, 1)[0]
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(f, "wb").write(bytes(data))
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 1)  # sizes still match
    with pytest.raises(CorruptCheckpointError):
        resume(ck, step_path(tmp_path, 1))


def test_overwrite_rules(tmp_path):
    model, opt = build()
    ck = make()
    ck.save(tmp_path, state_of(model, opt, 1), global_step=1)
    with pytest.raises(FileExistsError):
        ck.save(tmp_path, state_of(model, opt, 1), global_step=1)
    train(model, opt, range(1, 3))
    want = snap(model, opt)
    make(overwrite=True).save(tmp_path, state_of(model, opt, 1), global_step=1)
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", POINTER]
    assert_bitwise(snap(*resume(ck, step_path(tmp_path, 1))[:2]), want)


def test_crafted_metadata_runs_nothing(tmp_path):
    ck = make()
    save_steps(ck, tmp_path, [1, 2])
    marker = tmp_path / "pwned"
    with open(os.path.join(step_path(tmp_path, 2), ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 1)
    assert not marker.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- mutants: subtle, not broken --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_round_trips(tmp_path, name):
    ck = MUTANTS[name]()
    oracle = save_steps(ck, tmp_path, [1, 2], save_async=name.startswith("async"))
    assert ck.find_latest_checkpoint(tmp_path) == step_path(tmp_path, 2)
    model, opt, extra = resume(ck, step_path(tmp_path, 2))
    assert_bitwise(snap(model, opt), oracle[2])
    assert extra["global_step"] == 2


# -- mutants: each is really buggy (probe fails on it, passes on the original) ------------------
def _crash_at(ck, method):
    def boom(*a, **k):
        raise Crash(method)
    setattr(ck, method, boom)


def probe_pointer_before_commit(mk, root):
    save_steps(mk(), root, [1])
    ck = mk()
    _crash_at(ck, "_move_into_place")
    with pytest.raises(Crash):
        save_steps(ck, root, [2])
    raw = (root / POINTER).read_text().strip()
    return ck.check_step(step_path(root, int(raw))) is not None  # pointer never ahead of a commit


def probe_trusts_pointer(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    (root / POINTER).write_text("5\n")
    return ck.find_latest_checkpoint(root) == step_path(root, 2)


def probe_no_completeness_check(mk, root):
    ck = mk()
    save_steps(ck, root, [1])
    os.mkdir(step_path(root, 2))
    return ck.find_latest_checkpoint(root) == step_path(root, 1)


def probe_no_size_check(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    os.truncate(distcp(root, 2)[0], 10)
    return ck.find_latest_checkpoint(root) == step_path(root, 1)


def probe_no_checksum(mk, root):
    ck = mk()
    save_steps(ck, root, [1])
    f = distcp(root, 1)[0]
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(f, "wb").write(bytes(data))
    try:
        resume(ck, step_path(root, 1))
    except CorruptCheckpointError:
        return True
    return False


def probe_no_dir_fsync(mk, root, monkeypatch):
    import stat

    real, dirs = os.fsync, []
    monkeypatch.setattr(os, "fsync", lambda fd: (dirs.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real(fd))[1])
    save_steps(mk(), root, [1])
    return any(dirs)


def probe_unprimed_optimizer(mk, root):
    ck = mk()
    oracle = save_steps(ck, root, [2])
    model, opt, _ = resume(ck, step_path(root, 2), unprimed=True)
    try:
        assert_bitwise(snap(model, opt), oracle[2])
        return True
    except AssertionError:
        return False


def probe_swallowed_async_error(mk, root):
    model, opt = build()
    ck = mk()
    ck._move_into_place = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    ck.save(root, state_of(model, opt, 1), global_step=1, save_async=True)
    try:
        ck.maybe_wait_for_async_save()
    except Exception:  # noqa: BLE001
        return True
    return False


def probe_pointer_in_place(mk, root, monkeypatch):
    save_steps(mk(), root, [12])
    real = os.fsync

    def fsync(fd):
        real(fd)
        if POINTER in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            raise Crash("right after the first fsync of pointer bytes")

    monkeypatch.setattr(os, "fsync", fsync)
    model, opt = build()
    try:
        mk().save(root, state_of(model, opt, 34), global_step=34)
    except Crash:
        pass
    monkeypatch.setattr(os, "fsync", real)
    return (root / POINTER).read_text() in ("12\n", "34\n")


def probe_retention_deletes_newest(mk, root):
    ck = mk(keep_last=1)
    save_steps(ck, root, [1, 2, 3])
    return sorted(os.listdir(root)) == ["global_step_3", POINTER]


def probe_retention_keeps_the_oldest(mk, root):
    ck = mk(keep_last=1)
    save_steps(ck, root, [1, 2, 3])
    return not os.path.exists(step_path(root, 1)) and not os.path.exists(step_path(root, 2))


def probe_retention_leaks_descriptors(mk, root):
    ck = mk(keep_last=1)
    save_steps(ck, root, [1])
    before = len(os.listdir("/proc/self/fd"))
    save_steps(ck, root, [2, 3, 4])  # three deletions
    return len(os.listdir("/proc/self/fd")) <= before


def probe_fsync_before_flush(mk, root, monkeypatch):
    """Every fsync must find the file's bytes in the kernel: the size fstat reports at the last
    fsync of each file equals the size it has once the save returned."""
    real, synced = os.fsync, {}

    def fsync(fd):
        st = os.fstat(fd)
        synced[(st.st_dev, st.st_ino)] = st.st_size
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_steps(mk(), root, [1])
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            if synced.get((st.st_dev, st.st_ino)) != st.st_size:
                return False
    return True


def probe_overwrite_in_place(mk, root):
    oracle = save_steps(mk(), root, [1])
    ck = mk(overwrite=True)
    _crash_at(ck, "_persist")
    model, opt = build(5)
    with pytest.raises(Crash):
        ck.save(root, state_of(model, opt, 1), global_step=1)
    found = ck.find_latest_checkpoint(root)
    return found == step_path(root, 1) and torch.equal(snap(*resume(ck, found)[:2])["p.0.weight"], oracle[1]["p.0.weight"])


def probe_overwrites_silently(mk, root):
    ck = mk()
    save_steps(ck, root, [1])
    try:
        save_steps(ck, root, [1])
    except FileExistsError:
        return True
    return False


def probe_no_fallback_on_missing_extra(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    os.remove(os.path.join(step_path(root, 2), "extra_state", "extra_state_rank_0.pt"))
    return ck.find_latest_checkpoint(root) == step_path(root, 1)


def probe_async_no_snapshot(mk, root):
    model, opt = build()
    ck = mk()
    want = snap(model, opt)
    ck.save(root, state_of(model, opt, 1), global_step=1, save_async=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on right after save() returns
    ck.maybe_wait_for_async_save()
    return torch.equal(snap(*resume(ck, step_path(root, 1))[:2])["p.0.weight"], want["p.0.weight"])


def probe_unsafe_metadata_unpickle(mk, root):
    ck = mk()
    save_steps(ck, root, [1])
    marker = root / "pwned"
    with open(os.path.join(step_path(root, 1), ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    ck.find_latest_checkpoint(root)
    return not marker.exists()


def probe_retention_follows_links(mk, root):
    elsewhere = root / "elsewhere"
    save_steps(mk(), elsewhere, [1])
    save_steps(mk(), root / "r", [2])
    os.symlink(step_path(elsewhere, 1), step_path(root / "r", 1))
    save_steps(mk(keep_last=1), root / "r", [3])
    return os.path.isfile(os.path.join(step_path(elsewhere, 1), ".metadata"))


def probe_lazy_verify_fallback(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    extra = os.path.join(step_path(root, 2), "extra_state", "extra_state_rank_0.pt")
    with open(extra, "r+b") as f:  # one flipped bit: only reading the file finds it
        f.seek(os.path.getsize(extra) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    model, opt = build(seed=99)
    st = state_of(model, opt, -1)
    before = {k: v.detach().clone() for k, v in st["model"].items()}
    try:
        ck.load(step_path(root, 2), st)
    except CorruptCheckpointError:
        pass
    return all(torch.equal(before[k], v) for k, v in st["model"].items())


def probe_unchecked_extra_state(mk, root):
    import numpy as np

    model, opt = build()
    st = state_of(model, opt, 1)
    st["extra_state"]["np_rng"] = np.random.RandomState(0).get_state()
    ck = mk()
    try:
        ck.save(root, st, global_step=1)
    except ValueError:
        return ck.find_latest_checkpoint(root) is None  # refused at save: nothing published
    try:
        resume(ck, step_path(root, 1))
    except Exception:  # noqa: BLE001 - the mutant's acknowledged step does not resume
        return False
    return True


def probe_caller_error_falls_back(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    model, opt = build(seed=99)
    st = state_of(model, opt, -1)
    st["model"]["0.weight"] = None  # the caller's mistake, not damage
    try:
        ck.load_latest(root, st)
    except ValueError:
        return True
    except Exception:  # noqa: BLE001 - anything else: handled as damage
        return False
    return False


def probe_unbounded_record(mk, root):
    ck = mk()
    save_steps(ck, root, [1, 2])
    record = os.path.join(step_path(root, 2), ".metadata")
    with open(record, "rb") as f:
        data = f.read()
    with open(record, "wb") as f:  # the pickle without its trailer: a plain DCP record
        f.write(data[: data.rindex(b"\nindependent-ckpt record sha256:")])
    return ck.find_latest_checkpoint(root) == step_path(root, 1)


PROBES = {n[len("probe_"):]: f for n, f in list(globals().items()) if n.startswith("probe_")}


#: mutants whose bug needs several ranks or a process event (a signal, the interpreter's exit, a
#: fork): their probes are the suite's own tests (tests/test_suite_runs.py KILLERS)
NO_PROBE = {"embedded_rank_variant_extra", "interrupt_becomes_exception", "daemon_async_save", "fork_inherits_pending",
            "unagreed_caller_error", "interrupt_skips_agreement", "load_latest_never_relists", "sweeps_this_step_only",
            "sweeps_live_staging"}


def test_every_mutant_but_multi_rank_has_a_probe():
    assert set(MUTANTS) - set(PROBES) == NO_PROBE


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_passes_original_and_fails_mutant(tmp_path, monkeypatch, name):
    probe = PROBES[name]
    kw = {"monkeypatch": monkeypatch} if "monkeypatch" in probe.__code__.co_varnames[: probe.__code__.co_argcount] else {}
    (tmp_path / "orig").mkdir()
    (tmp_path / "mut").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert probe(lambda **k: IndependentCheckpointer(**k), tmp_path / "orig", **kw), "original fails the probe"
        monkeypatch.undo()
        assert not probe(MUTANTS[name], tmp_path / "mut", **kw), f"mutant {name} passes the probe"
