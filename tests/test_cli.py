"""The ``refckpt`` command line: ls, verify, inspect, convert, example, help and exit codes.

Real checkpoints written by refckpt (``conftest.template``: steps 4 and 42 of a tiny AdamW run),
damaged with byte-level surgery, read back through ``main([...])`` in this process and, once
per exit-code path that matters to scripts, through the installed console script. Every
expectation is known independently of the code under test: shapes from the model built here,
tensors kept from before the save, file sizes from ``os.stat``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from refckpt import DistributedCheckpointer, check_step_dir, get_training_state, set_training_state
from refckpt.tools.cli import ProgressBar, main
from refckpt.tools.readers import optimizer_kind

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

COMMANDS = ("example", "ls", "verify", "inspect", "convert")
#: tensor shapes of B.make_model(): Linear(4, 5), Tanh, Linear(5, 2)
SHAPES = {"0.weight": [5, 4], "0.bias": [5], "2.weight": [2, 5], "2.bias": [2]}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``refckpt`` with ``argv``: (exit code, stdout, stderr)."""
    return B.run_main(main, capsys, *argv)


def tree_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def flip_tensor_byte(step_dir: str, key: str = "model.0.weight") -> str:
    shard = os.path.join(step_dir, B.SHARD)
    start, _end = B.item_range(shard, key)
    B.flip_bit(shard, start + 1, bit=3)
    return shard


# ================================================================================================
# help and usage
# ================================================================================================
@pytest.mark.parametrize("cmd", [None, *COMMANDS])
def test_every_command_has_help_with_exit_codes(capsys, cmd):
    code, out, _ = run(capsys, *([cmd] if cmd else []), "--help")
    assert code == 0
    assert out.startswith(f"usage: refckpt{' ' + cmd if cmd else ''}")
    assert "exit codes:" in out and "  2  usage error or bad input" in out
    if cmd is None:
        for c in COMMANDS:
            assert f"refckpt {c}" in out  # one line per command in the epilog


@pytest.mark.parametrize("argv", [["ls"], ["convert", "x"], ["verify", "a", "b"], ["convert", "a", "b", "--step", "-1"]])
def test_missing_or_bad_arguments_exit_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2 and "usage: refckpt" in err


@pytest.mark.parametrize("cmd", ["ls", "verify", "inspect"])
def test_nonexistent_path_exits_2_naming_it(capsys, tmp_path, cmd):
    missing = tmp_path / "no" / "such"
    code, out, err = run(capsys, cmd, missing)
    assert code == 2 and out == ""
    assert str(missing) in err and f"refckpt {cmd}: error:" in err and "pass" in err


@pytest.mark.parametrize("cmd", ["ls", "verify", "inspect"])
def test_a_file_or_a_plain_directory_is_bad_input(capsys, tmp_path, cmd):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    code, _, err = run(capsys, cmd, f)
    assert code == 2 and str(f) in err
    if cmd != "ls":  # ls lists an empty directory (next test); the others need a checkpoint
        plain = tmp_path / "plain"
        plain.mkdir()
        code, _, err = run(capsys, cmd, plain)
        assert code == 2 and str(plain) in err and "neither a checkpoint root" in err


# ================================================================================================
# ls
# ================================================================================================
def test_ls_empty_root_lists_nothing_and_exits_0(capsys, tmp_path):
    code, out, _ = run(capsys, "ls", tmp_path)
    assert code == 0
    assert "no step directories" in out and "nothing (no complete step)" in out


def test_ls_on_a_step_directory_points_to_the_root(capsys, ckpt):
    _root, _s4, s42 = ckpt
    code, _, err = run(capsys, "ls", s42)
    assert code == 2 and "is a step directory" in err and "refckpt inspect" in err


def _damaged_root(ckpt) -> tuple[str, dict[int, str]]:
    """ckpt plus three newer steps: missing shard (50), no commit record (60), garbage commit
    record (70); pointer at 70. Returns the root and step -> directory."""
    root, s4, s42 = ckpt
    dirs = {4: s4, 42: s42}
    for step in (50, 60, 70):
        dirs[step] = os.path.join(root, f"global_step_{step}")
        shutil.copytree(s42, dirs[step])
    os.unlink(os.path.join(dirs[50], B.SHARD))
    os.unlink(os.path.join(dirs[60], ".metadata"))
    with open(os.path.join(dirs[70], ".metadata"), "wb") as f:
        f.write(b"\x80\x05garbage")
    B.write_pointer(root, b"70\n")
    os.mkdir(os.path.join(root, ".global_step_80.partial"))
    return root, dirs


def test_ls_reports_each_step_and_what_resume_picks(capsys, ckpt):
    root, dirs = _damaged_root(ckpt)
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln[:1].isdigit()}
    assert list(lines) == ["70", "60", "50", "42", "4"]  # newest first
    assert lines["70"].split()[1] == "corrupt" and "cannot parse the commit record" in lines["70"]
    assert lines["60"].split()[1] == "incomplete" and "no commit record" in lines["60"]
    assert lines["50"].split()[1] == "incomplete" and f"missing file {B.SHARD}" in lines["50"]
    assert lines["42"].split()[1] == "complete" and lines["42"].rstrip().endswith("<- resume")
    assert "<- resume" not in lines["4"] and "per-rank" in lines["4"] and "refckpt/2" in lines["4"]
    assert 'pointer  latest_checkpoint_iteration.txt = "70": names global_step_70, which is corrupt: ignored' in out
    assert "resume   global_step_42" in out
    assert "staging  .global_step_80.partial" in out


def test_ls_json_content(capsys, ckpt):
    root, dirs = _damaged_root(ckpt)
    code, out, _ = run(capsys, "ls", "--json", root)
    assert code == 0
    data = json.loads(out)
    assert data["root"] == root and data["resume"] == dirs[42] and data["resume_step"] == 42
    assert data["pointer"]["raw"] == "70\n" and data["pointer"]["step"] == 70
    steps = {s["step"]: s for s in data["steps"]}
    assert [s["step"] for s in data["steps"]] == [70, 60, 50, 42, 4]
    assert {k: s["state"] for k, s in steps.items()} == {
        70: "corrupt", 60: "incomplete", 50: "incomplete", 42: "complete", 4: "complete"}
    for step in (4, 42):
        s = steps[step]
        assert s["reason"] == "" and s["path"] == dirs[step] and s["name"] == f"global_step_{step}"
        assert s["size_bytes"] == tree_size(dirs[step])
        assert (s["world_size"], s["world_size_source"]) == (1, "manifest")
        assert (s["extra_state"], s["format"], s["checksums"]) == ("per_rank", "refckpt/2", "crc32c")
    assert steps[60]["extra_state"] == "per_rank"   # extra_state/ dir present, no commit record to say more
    assert (steps[60]["world_size"], steps[60]["world_size_source"]) == (1, "file names")
    assert steps[70]["format"] is None and steps[60]["format"] is None
    assert data["staging"] == [".global_step_80.partial"]


@pytest.mark.parametrize("pointer,note", [
    (None, "absent"),
    (b"42\n", "agrees with resume"),
    (b"4\n", "stale: names global_step_4; the newest complete step is global_step_42"),
    (b"4", "stale: names global_step_4"),
    (b"9999\n", "names global_step_9999, which does not exist (dangling): ignored"),
    (b"4x\n", "unreadable (torn, empty or garbage): ignored"),
    (b"", "unreadable"),
])
def test_ls_says_what_the_pointer_means(capsys, ckpt, pointer, note):
    root, _s4, s42 = ckpt
    if pointer is None:
        os.unlink(os.path.join(root, "latest_checkpoint_iteration.txt"))
    else:
        B.write_pointer(root, pointer)
    code, out, _ = run(capsys, "ls", "--json", root)
    data = json.loads(out)
    assert code == 0 and data["resume"] == s42  # the pointer never changes the answer
    assert data["pointer"]["note"].startswith(note)


# ================================================================================================
# verify
# ================================================================================================
def test_verify_passes_a_clean_step_and_root(capsys, ckpt):
    root, s4, _s42 = ckpt
    code, out, err = run(capsys, "verify", s4)
    assert code == 0 and err == ""  # stderr is not a terminal: no progress bar
    assert "global_step_4: OK (2 files" in out and "every byte matches its crc32" in out
    code, out, _ = run(capsys, "verify", root)
    assert code == 0
    assert "all 2 step(s) intact; resume would load global_step_42" in out


def test_verify_catches_a_flipped_byte_naming_the_file(capsys, ckpt):
    root, s4, s42 = ckpt
    shard = flip_tensor_byte(s42)
    assert check_step_dir(s42).complete  # sizes intact: only reading the bytes can tell
    code, out, _ = run(capsys, "verify", s42)
    assert code == 1
    assert "global_step_42: FAIL" in out and f"{shard}: bytes " in out and "fail their crc32" in out
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    assert "global_step_4: OK" in out and "1 of 2 step(s) have problems" in out and shard in out
    code, out, _ = run(capsys, "verify", "--json", root)
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    bad = [s for s in data["steps"] if not s["ok"]]
    assert [s["path"] for s in bad] == [s42] and shard in bad[0]["problems"][0]


def test_verify_names_a_damaged_extra_state_file_and_an_incomplete_step(capsys, ckpt):
    root, s4, s42 = ckpt
    extra = os.path.join(s4, B.EXTRA_REL)
    B.flip_bit(extra, os.path.getsize(extra) // 2)
    os.unlink(os.path.join(s42, ".metadata"))
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    assert f"{extra}: bytes 0..{os.path.getsize(extra)} fail their crc32" in out
    assert f"{s42}: incomplete: no commit record" in out
    # sizes are intact, so resume still picks step 4 (load_latest would then fall back, loudly)
    assert "2 of 2 step(s) have problems; resume would load global_step_4" in out


def test_verify_step_files_reports_every_damaged_file_not_only_the_first(ckpt):
    """A step whose files changed after its record was read (the shard grew a byte, the extra state
    has a flipped bit): every file's problem is reported, not only the first file's."""
    from refckpt.storage.verify import verify_step_files

    _root, s4, _s42 = ckpt
    manifest = check_step_dir(s4).manifest
    shard, extra = os.path.join(s4, B.SHARD), os.path.join(s4, B.EXTRA_REL)
    assert sorted(manifest.files) == sorted(os.path.relpath(p, s4) for p in (shard, extra))
    with open(shard, "ab") as f:
        f.write(b"\0")
    B.flip_bit(extra, os.path.getsize(extra) // 2)
    problems = verify_step_files(s4, manifest)
    assert len(problems) == 2 and shard in problems[0] and "commit record says" in problems[0], problems
    assert extra in problems[1] and "fail their crc32" in problems[1], problems


def test_verify_quiet_prints_problems_only(capsys, ckpt):
    root, _s4, s42 = ckpt
    code, out, err = run(capsys, "verify", "--quiet", "--progress", root)
    assert (code, out, err) == (0, "", "")
    shard = flip_tensor_byte(s42)
    code, out, err = run(capsys, "verify", "--quiet", root)
    assert code == 1 and err == ""
    assert out.splitlines()[0] == "global_step_42: FAIL" and shard in out and "OK" not in out


def test_verify_progress_bar_goes_to_stderr(capsys, ckpt):
    root, s4, s42 = ckpt
    code, out, err = run(capsys, "verify", "--progress", root)
    assert code == 0 and "\r" not in out
    frames = [f for f in err.split("\r") if f.strip()]
    assert frames[-1].startswith(f"[{'#' * 24}] 100% ")
    assert any(f.rstrip().endswith("global_step_42/__0_0.safetensors") for f in frames)
    assert all(len(f) < ProgressBar.DEFAULT_WIDTH for f in frames)  # never wraps
    total = f"{(tree_size(s4) + tree_size(s42)) / 1024:.1f} KiB"
    assert f" 100% {total}/{total} " in frames[-1]


# ================================================================================================
# inspect
# ================================================================================================
def test_inspect_shows_keys_shapes_dtypes_optimizer_and_extra_state(capsys, ckpt):
    _root, _s4, s42 = ckpt
    code, out, _ = run(capsys, "inspect", s42)
    assert code == 0
    assert "complete, format refckpt/2, world size 1, checksums crc32" in out
    for key, shape in SHAPES.items():
        for shown in (key, f"state.{key}.exp_avg_sq"):
            row = rf"^  {re.escape(shown)}\s+{re.escape(str(shape))}\s+float32\s+1 \(whole, {re.escape(B.SHARD)}\)$"
            assert re.search(row, out, re.M), (shown, out)
    assert "optimizer: 12 tensors" in out and "kind AdamW" in out
    assert "group 0: AdamW, 4 params (4 with state): lr=0.01 betas=[0.9, 0.999]" in out and "weight_decay=0.1" in out
    assert "state entries: exp_avg, exp_avg_sq, step for 4 params" in out
    assert "extra_state (1 per-rank file(s), read from rank 0):\n  global_step: 42" in out


def test_inspect_json(capsys, ckpt):
    root, _s4, s42 = ckpt
    code, out, _ = run(capsys, "inspect", "--json", root)  # a root: the step resume picks
    assert code == 0
    data = json.loads(out)
    assert data["path"] == s42 and "resume picks" in data["note"] and data["errors"] == []
    tensors = {e["key"]: e for e in data["entries"] if e["kind"] == "tensor"}
    for key, shape in SHAPES.items():
        e = tensors[f"model.{key}"]
        assert (e["shape"], e["dtype"], e["nbytes"]) == (shape, "float32", 4 * torch.Size(shape).numel())
        assert e["chunks"] == [{"offsets": [0] * len(shape), "sizes": shape, "file": B.SHARD}]
        assert tensors[f"optimizer.state.{key}.exp_avg"]["shape"] == shape
    assert data["optimizer"]["kind"] == "AdamW"
    hyper = data["optimizer"]["groups"][0]["hyperparameters"]
    assert (hyper["lr"], hyper["betas"], hyper["weight_decay"], hyper["amsgrad"]) == (0.01, [0.9, 0.999], 0.1, False)
    assert data["extra_state"] == {"layout": "per_rank", "files": 1, "keys": {"global_step": "42"},
                                   "error": None, "read_from": "rank 0"}
    assert data["tops"]["model"] == {"tensors": 4, "items": 0, "nbytes": 4 * 37}


@pytest.mark.parametrize("kind,name", [
    ("adam", "Adam"), ("adamw_amsgrad", "AdamW (amsgrad)"), ("sgd_nesterov", "SGD (momentum)"),
    ("rmsprop", "RMSprop (momentum)"), ("adagrad", "Adagrad"),
])
def test_inspect_names_the_optimizer(capsys, tmp_path, kind, name):
    step_dir, _p, _o = B.save_trained(tmp_path, 2, kind=kind)
    code, out, _ = run(capsys, "inspect", "--json", step_dir)
    data = json.loads(out)
    assert code == 0 and data["optimizer"]["kind"] == name
    assert data["optimizer"]["groups"][0]["hyperparameters"]["lr"] == B.OPTIMIZERS[kind](
        B.make_model().parameters()).param_groups[0]["lr"]


def test_inspect_embedded_extra_state_keys(capsys, tmp_path):
    model, opt = B.make(0)
    B.train(model, opt, range(2))
    rng = torch.get_rng_state()
    B.save(tmp_path, model, opt, 2, extra={"global_step": 2, "rng": rng, "sampler": {"epoch": 1}},
           extra_state_per_rank=False)
    code, out, _ = run(capsys, "inspect", tmp_path / "global_step_2")
    assert code == 0
    assert "extra_state (embedded in the DCP payload):" in out
    assert f"  rng: tensor uint8 [{rng.numel()}]" in out and "  sampler: dict (1 keys)" in out
    assert "  global_step: 2" in out


def test_inspect_reports_unreadable_items_with_exit_1(capsys, ckpt):
    _root, s4, _s42 = ckpt
    B.flip_bit(os.path.join(s4, B.EXTRA_REL), 100)
    code, out, err = run(capsys, "inspect", s4)
    assert code == 1 and "model: 4 tensors" in out  # the metadata still shows
    assert "problem:" in err and "extra_state_rank_0.pt" in err and "crc32" in err


def test_optimizer_kind_from_state_entries():
    assert optimizer_kind({"step", "exp_avg", "exp_avg_sq"}) == "Adam/AdamW"
    assert optimizer_kind({"step", "exp_avg", "exp_avg_sq"}, {"decoupled_weight_decay": False}) == "Adam"
    assert optimizer_kind({"step", "exp_avg", "exp_inf"}) == "Adamax"
    assert optimizer_kind({"step", "exp_avg", "exp_avg_sq", "mu_product"}) == "NAdam"
    assert optimizer_kind({"square_avg", "grad_avg", "step"}) == "RMSprop (centered)"
    assert optimizer_kind({"square_avg", "acc_delta", "step"}) == "Adadelta"
    assert optimizer_kind(set(), {"momentum": 0, "nesterov": False}) == "SGD (no momentum state)"
    assert optimizer_kind({"mystery"}) == "unknown (mystery)"


# ================================================================================================
# convert
# ================================================================================================
def test_convert_to_safetensors_round_trips_the_saved_tensors(capsys, ckpt, template, tmp_path):
    from safetensors import safe_open

    _root, _s4, s42 = ckpt
    out_file = tmp_path / "model.safetensors"
    code, out, _ = run(capsys, "convert", s42, out_file)
    assert code == 0 and f"wrote {out_file}: one safetensors file, 4 tensors" in out
    with safe_open(str(out_file), "pt") as f:
        assert set(f.keys()) == set(SHAPES)
        got = {k: f.get_tensor(k) for k in f.keys()}
        assert f.metadata()["refckpt.global_step"] == "42"
    B.assert_bitwise(got, template[1][42])
    code, _, err = run(capsys, "convert", s42, out_file)  # never clobbers silently
    assert code == 2 and str(out_file) in err and "--force" in err


def test_convert_with_optimizer_adds_flattened_moments(capsys, tmp_path):
    from safetensors import safe_open

    step_dir, params, opt_sd = B.save_trained(tmp_path / "root", 3, kind="adamw_amsgrad")
    out_file = tmp_path / "full.safetensors"
    code, _, _ = run(capsys, "convert", "--with-optimizer", step_dir, out_file)
    assert code == 0
    with safe_open(str(out_file), "pt") as f:
        keys = set(f.keys())
        for fqn in SHAPES:
            for entry in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
                key = f"optimizer.state.{fqn}.{entry}"
                assert key in keys
        # the optimizer's own state dict is id-keyed, in parameter order
        for i, fqn in enumerate(SHAPES):
            for entry, want in opt_sd["state"][i].items():
                B.assert_bitwise(f.get_tensor(f"optimizer.state.{fqn}.{entry}"), want, f"{fqn}.{entry}")
        B.assert_bitwise({k: f.get_tensor(k) for k in SHAPES}, params)
        groups = json.loads(f.metadata()["optimizer.param_groups"])
    assert groups[0]["lr"] == 0.01 and groups[0]["amsgrad"] is True and groups[0]["params"] == list(SHAPES)


def test_fsdp2_shards_show_as_chunks_and_convert_consolidates_them(capsys, tmp_path):
    """FSDP2 state saved at 2 ranks: each tensor is two row chunks in two files. The reference is
    torch's own full_state_dict gathered in the ranks, independent of refckpt."""
    from safetensors import safe_open

    from faults.world import run_world

    from . import _fsdp_fns as fns

    root = tmp_path / "fsdp"
    full = run_world(fns.save_fsdp, 2, str(root), False, start_method="forkserver", timeout=120)[0]["full"]
    code, out, _ = run(capsys, "inspect", "--json", root)
    data = json.loads(out)
    assert code == 0 and data["world_size"] == 2
    w = {e["key"]: e for e in data["entries"]}["model.0.weight"]
    assert w["shape"] == [fns.HIDDEN, fns.IN]
    half = fns.HIDDEN // 2
    assert sorted((c["offsets"], c["sizes"], c["file"]) for c in w["chunks"]) == [
        ([0, 0], [half, fns.IN], "__0_0.safetensors"), ([half, 0], [half, fns.IN], "__1_0.safetensors")]
    assert data["optimizer"]["kind"] == "AdamW (amsgrad)"

    out_file = tmp_path / "full.safetensors"
    assert run(capsys, "convert", "--with-optimizer", root, out_file)[0] == 0
    with safe_open(str(out_file), "pt") as f:
        B.assert_bitwise({k: f.get_tensor(k) for k in full["model"]}, full["model"])
        for fqn, entries in full["optimizer"]["state"].items():
            for entry, want in entries.items():
                B.assert_bitwise(f.get_tensor(f"optimizer.state.{fqn}.{entry}"), want, f"{fqn}.{entry}")


def _trained_torch_save(tmp_path):
    model, opt = B.make(3, "sgd_nesterov")
    B.train(model, opt, range(3))
    path = tmp_path / "plain.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    return path, B.params(model), B.opt_snapshot(opt)


@pytest.mark.parametrize("primed", [False, True], ids=["fresh_optimizer", "trained_optimizer"])
def test_convert_torch_save_into_refckpt_then_load_latest_restores_bitwise(capsys, tmp_path, primed):
    """A plain ``optimizer.state_dict()`` is keyed by int ids; convert writes it keyed by parameter
    name (tests/test_convert_optimizer.py), so the README's resume recipe fills every moment: no
    entry is "absent" (an int-keyed target used to pass by accident, torch merging old and new keys)."""
    path, params, opt_sd = _trained_torch_save(tmp_path)
    root = tmp_path / "root"
    code, out, _ = run(capsys, "convert", path, root, "--step", "7")
    assert code == 0 and f"wrote {root / 'global_step_7'}: refckpt step" in out
    assert "epoch saved into extra_state" in out
    assert (root / "latest_checkpoint_iteration.txt").read_text() == "7\n"
    st = check_step_dir(str(root / "global_step_7"))
    assert st.complete and st.manifest.checksum == "crc32c"
    assert run(capsys, "verify", root)[0] == 0

    fresh, fopt = B.make(99, "sgd_nesterov")
    if primed:
        B.train(fresh, fopt, range(50, 51))
    state = get_training_state(fresh, fopt, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert DistributedCheckpointer().load_latest(root, state) == str(root / "global_step_7")
    assert not [w for w in caught if "absent" in str(w.message)], [str(w.message) for w in caught]
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), params)
    B.assert_bitwise(B.opt_snapshot(fopt), opt_sd)
    assert state["extra_state"] == {"epoch": 3, "global_step": 7}


def test_convert_plain_dcp_into_refckpt_then_load_latest_restores_bitwise(capsys, tmp_path):
    model, opt = B.make(0, "adamw_amsgrad")
    B.train(model, opt, range(5))
    msd, osd = get_state_dict(model, opt)
    src = tmp_path / "dcp"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(src), no_dist=True)
    os.makedirs(src / "extra_state")
    torch.save({"global_step": 5, "sampler": [4, 2]}, src / "extra_state" / "extra_state_rank_0.pt")
    params, opt_sd = B.params(model), B.opt_snapshot(opt)

    code, out, _ = run(capsys, "verify", src)  # no checksums: every item read and parsed
    assert code == 0 and "no checksums recorded" in out
    root = tmp_path / "root"
    code, out, _ = run(capsys, "convert", src, root, "--step", "5")
    assert code == 0 and "read " + str(src) + " (dcp)" in out
    assert check_step_dir(str(root / "global_step_5")).manifest is not None  # now refckpt's, with checksums

    fresh, fopt = B.make(99, "adamw_amsgrad")
    state = get_training_state(fresh, fopt, {})
    assert DistributedCheckpointer().load_latest(root, state) == str(root / "global_step_5")
    extra = set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), params)
    B.assert_bitwise(fopt.state_dict(), opt_sd)
    assert extra == {"global_step": 5, "sampler": [4, 2]}

    out_file = tmp_path / "dcp.safetensors"  # plain DCP -> safetensors when OUT says so
    assert run(capsys, "convert", src, out_file)[0] == 0
    from safetensors.torch import load_file

    B.assert_bitwise(load_file(str(out_file)), params)


def test_convert_never_executes_a_pickle(capsys, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(B.malicious_pickle(str(marker)))
    code, _, err = run(capsys, "convert", evil, tmp_path / "root")
    assert code == 2 and str(evil) in err and "refusing to unpickle" in err
    assert not marker.exists() and not (tmp_path / "root").exists()


@pytest.mark.parametrize("case", ["text_file", "empty_dir", "missing", "opt_flag_into_refckpt", "torch_save_to_safetensors",
                                  "incomplete_step", "step_for_safetensors"])
def test_convert_bad_inputs_exit_2_naming_the_path(capsys, ckpt, tmp_path, case):
    _root, _s4, s42 = ckpt
    src, out, extra = tmp_path / "in", tmp_path / "out", []
    if case == "text_file":
        src.write_text("not a checkpoint\n")
        want = "not a torch.save file"
    elif case == "empty_dir":
        src.mkdir()
        want = "neither a checkpoint root"
    elif case == "missing":
        want = "no such file or directory"
    elif case == "incomplete_step":
        os.unlink(os.path.join(s42, B.SHARD))
        src, want = s42, "not a complete checkpoint"
    elif case == "step_for_safetensors":
        src, extra, want = s42, ["--step", "3"], "--step applies to conversions into refckpt's layout"
    else:
        src, *_ = _trained_torch_save(tmp_path)
        if case == "opt_flag_into_refckpt":
            extra, want = ["--with-optimizer"], "--with-optimizer applies to safetensors output"
        else:
            out, want = tmp_path / "x.safetensors", "converts into refckpt's layout only"
    code, stdout, err = run(capsys, "convert", src, out, *extra)
    assert code == 2 and stdout == ""
    assert want in err and str(src) in err


# ================================================================================================
# the installed console script (exit codes reach the shell)
# ================================================================================================
def test_console_script_exit_code_reaches_the_shell(ckpt):
    root, _s4, s42 = ckpt
    exe = shutil.which("refckpt", path=os.path.dirname(sys.executable)) or shutil.which("refckpt")
    assert exe, "the refckpt console script is not installed (pip install -e .)"
    shard = flip_tensor_byte(s42)
    verify = subprocess.run([exe, "verify", root], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1, verify.stderr
    assert "global_step_42: FAIL" in verify.stdout and shard in verify.stdout
    # (exit code 2 takes the same path out of main(); the in-process tests above cover it)


# -- command line ----------------------------------------------------------------------------------
def test_cli_help_lists_the_example_command(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: refckpt") and "example" in out


@pytest.mark.parametrize("argv,match", [
    ([], "the following arguments are required: cmd"),
    (["restore"], "invalid choice: 'restore'"),
    (["example", "--world-size", "two"], "expected a positive integer, got 'two'"),
])
def test_cli_rejects_bad_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv,code", [(["example", "--help"], 0), (["example", "--steps"], 2)])
def test_python_dash_m_refckpt_runs_the_cli(capsys, monkeypatch, argv, code):
    """``python -m refckpt`` executes refckpt/__main__.py, which exits with the CLI's status.
    (Executed in this process, as the module ``-m`` would run, to avoid starting another torch.)"""
    monkeypatch.setattr(sys, "argv", ["refckpt", *argv])
    spec = importlib.util.find_spec("refckpt.__main__")
    assert spec is not None and spec.origin.endswith(os.path.join("refckpt", "__main__.py"))
    with pytest.raises(SystemExit) as ei:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert ei.value.code == code
    out, err = capsys.readouterr()
    if code == 0:
        assert "usage: refckpt example" in out and "--world-size" in out and "--every" in out
    else:
        assert "argument --steps: expected one argument" in err


def test_cli_example_rejects_an_empty_world(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_example's work dir lands here
    with pytest.raises(SystemExit) as ei:
        main(["example", "--dir", str(tmp_path / "ckpt"), "--world-size", "0"])
    assert ei.value.code == 2 and "--world-size" in capsys.readouterr().err
