"""``faults.adapters.veomni:VeOmni``: VeOmni 0.1.12's DCP checkpointer behind the harness contract.

Round trips in a 1-rank and a 2-rank gloo world (``faults.plugin``'s ``world_factory``: VeOmni
calls ``dist.get_rank()`` unguarded, so nothing runs outside a world), checkpoints written by
VeOmni's own ``save``/``load`` with live objects against the adapter's, ``find_latest_checkpoint``
against VeOmni's ``get_checkpoint_path``, extra state, async failures, the import path.

Tests named ``test_veomni_defect_*`` show a defect of VeOmni itself (they are the evidence the
adapter's report cites): each one ``xfail``s, strictly, with the defect as its reason, so a
VeOmni that fixes it turns the test into a failure that says so.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest

pytest.importorskip("torch.distributed.checkpoint", reason="torch is not importable here")

import torch  # noqa: E402

from faults.adapters import Unavailable  # noqa: E402
from faults.contract import Capability, Checkpointer, capabilities_of  # noqa: E402
from faults.training import ModelSpec, OptimSpec, RunConfig, load_factory  # noqa: E402
from tests import _veomni_fns as fns  # noqa: E402

# Imported by the fixture below, not at collection: veomni imports transformers (about 2 CPU s),
# and every xdist worker collects every module, most of them never running a test of this one.
veomni_adapter: Any = None
VeOmni: Any = None


@pytest.fixture(scope="module", autouse=True)
def _veomni() -> None:
    global veomni_adapter, VeOmni
    veomni_adapter = pytest.importorskip(
        "faults.adapters.veomni", exc_type=ImportError,
        reason="faults.adapters.veomni cannot be imported (pip install --no-deps 'veomni==0.1.12' "
               "&& pip install 'transformers==5.9.0')")
    VeOmni = veomni_adapter.VeOmni

# One xdist worker for the module: VeOmni imports transformers (about 2 CPU s in the worker, again in each rank), so
# spread over `pytest -n 8`'s workers it was paid once per worker and per world.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
              pytest.mark.xdist_group("peer-veomni")]

#: VeOmni's ``utils.device`` picks ``torch.<cuda|npu|mlu|cpu>``; only the CPU namespace lacks
#: ``empty_cache``, which VeOmni's sync save calls after writing.
ACCELERATOR = torch.cuda.is_available()
EMPTY_CACHE_DEFECT = ("VeOmni defect: on a host without CUDA/NPU/MLU, execute_save's sync branch calls "
                      "veomni.utils.device.empty_cache() -> torch.cpu.empty_cache, which torch does not have: "
                      "every sync save raises AttributeError after it has written (and committed) the step")
PER_RANK = RunConfig(ModelSpec(), OptimSpec(("adamw", "sgd_momentum")), extra_per_rank=True)


# -- the factory ------------------------------------------------------------------------------


def test_factory_declares_per_rank_extra_state_only_and_follows_the_protocol():
    factory = load_factory("faults.adapters.veomni:VeOmni")
    assert factory is VeOmni
    assert capabilities_of(factory) == frozenset({Capability.PER_RANK_EXTRA_STATE})
    ck = factory()
    assert isinstance(ck, Checkpointer)
    assert veomni_adapter.PACKAGE == "veomni"
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer

    assert ck._ck is DistributedCheckpointer  # what build_checkpointer("dcp", ...) returns


def test_missing_veomni_raises_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "veomni.checkpoint", None)
    monkeypatch.delitem(sys.modules, "faults.adapters.veomni")
    with pytest.raises(Unavailable, match=r"veomni==0\.1\.12.*pip install --no-deps 'veomni==0\.1\.12'"):
        importlib.import_module("faults.adapters.veomni")


# -- round trips ------------------------------------------------------------------------------


def test_one_rank_async_round_trip(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.round_trip, str(tmp_path), PER_RANK, True)[0]
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["same_dict"]
    assert r["listing"] == ["global_step_2", "global_step_3"]  # no pointer file: VeOmni writes none
    assert r["step"] == 3 and r["digest"] == r["reference"]


def test_one_rank_async_round_trip_bf16_tied_frozen_unused(world_factory, tmp_path):
    cfg = RunConfig(ModelSpec(dtype="bfloat16", tied=True, frozen=True, unused=True, depth=2),
                    OptimSpec(("adam_amsgrad", "rmsprop", "adagrad")))
    r = world_factory.get(1).run(fns.round_trip, str(tmp_path), cfg, True, (1, 4), 1)[0]
    assert r["path"] == fns.step_dir(str(tmp_path), 4)
    assert r["step"] == 4 and r["digest"] == r["reference"]


def test_one_rank_sync_round_trip(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.guarded, fns.round_trip, str(tmp_path), PER_RANK, False)[0]
    if not ACCELERATOR:
        assert "AttributeError: module 'torch.cpu' has no attribute 'empty_cache'" in r["error"]
        pytest.xfail(EMPTY_CACHE_DEFECT)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["step"] == 3 and r["digest"] == r["reference"]


def test_two_rank_async_round_trip(world_factory, tmp_path):
    results = world_factory.get(2).run(fns.round_trip, str(tmp_path), PER_RANK, True)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], (
            f"rank {rank}: restored state (per-rank extra state included) differs from the uninterrupted run")
    assert results[0]["digest"] != results[1]["digest"]  # per-rank extra state really differs


def test_two_rank_fsdp2_async_round_trip(world_factory, tmp_path):
    cfg = RunConfig(ModelSpec(depth=2), OptimSpec(("adamw",)), sharding="fsdp2", extra_per_rank=True)
    results = world_factory.get(2).run(fns.round_trip, str(tmp_path), cfg, True, (3,), 1)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3)
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"


def test_two_rank_sync_round_trip(world_factory, tmp_path):
    results = world_factory.get(2).run(fns.guarded, fns.round_trip, str(tmp_path), PER_RANK, False)
    if not ACCELERATOR:
        for r in results:  # both ranks, after the barrier: the world stays consistent
            assert "torch.cpu' has no attribute 'empty_cache'" in r["error"]
        pytest.xfail(EMPTY_CACHE_DEFECT)
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"


def test_adapter_and_veomnis_own_save_and_load_agree(world_factory, tmp_path):
    """VeOmni's ``DistributedCheckpointer.save``/``load`` with the live model and optimizers (as
    its trainer calls them) and the adapter write the same files and DCP keys, and each loads
    the other's checkpoint bitwise."""
    r = world_factory.get(1).run(fns.cross_check, str(tmp_path), PER_RANK)[0]
    assert r["adapter_tree"] == r["native_tree"]
    assert "extra_state/extra_state_rank_0.pt" in r["adapter_tree"] and ".metadata" in r["adapter_tree"]
    assert r["adapter_keys"] == r["native_keys"]
    assert r["adapter_loads_native"] == r["reference"]
    assert r["native_loads_adapter"] == r["reference"]


# -- load: extra state, strictness ------------------------------------------------------------


def test_extra_state_only_with_a_skeleton_and_load_options(world_factory, tmp_path):
    results = world_factory.get(2).run(fns.extra_state_behaviour, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["no_skeleton_same"] and not r["no_skeleton_has_extra"]
        assert r["marker_untouched"]
        assert r["skeleton_untouched"]  # VeOmni replaces the extra state; the skeleton is a marker
        assert r["loaded_step"] == 2 and r["rng_equal"] and r["rank"] == rank
        assert r["files"] == ["extra_state_rank_0.pt", "extra_state_rank_1.pt"]
        assert "DCP is missing 1 model key(s) required for a full-model resume: model.not_in_checkpoint" in (
            r["strict_error"] or "")
        assert "ValueError: Model must be provided to load a distributed checkpoint." in r["no_model_error"]


# -- async saves ------------------------------------------------------------------------------


def test_async_failure_raises_from_the_wait_once(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.async_failure, str(tmp_path), "wait")[0]
    first, second, poll = r["errors"]
    assert first is not None and "Is a directory" in first
    assert second is None and poll is None
    assert r["latest"] is None  # no commit record was written


def test_async_failure_raises_from_the_poll_once_done(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.async_failure, str(tmp_path), "poll")[0]
    first, second, wait = r["errors"]
    assert first is not None and "Is a directory" in first
    assert second is None and wait is None
    assert r["latest"] is None


def test_async_failure_raises_from_the_next_async_save(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.async_failure, str(tmp_path), "next_save")[0]
    save, wait = r["errors"]
    assert save is not None and "Is a directory" in save
    assert wait is None
    # VeOmni wrote the next step's extra state before it waited for (and raised) the earlier save
    assert r["step2"] == ["extra_state"]
    assert r["latest"] is None


def test_raise_for_failed_leaves_a_running_save_alone(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.running_save_is_left_alone, str(tmp_path))[0]
    assert r["pending_after_poll"] and r["cleared"]
    assert r["latest"] == fns.step_dir(str(tmp_path), 1)


# -- find_latest_checkpoint: VeOmni's own finder, on the root ----------------------------------


def _layout(root, complete=(), incomplete=(), metadata_dir=(), files=()):
    os.makedirs(root, exist_ok=True)
    for name in complete:
        os.makedirs(os.path.join(root, name), exist_ok=True)
        open(os.path.join(root, name, ".metadata"), "wb").close()
    for name in incomplete:
        os.makedirs(os.path.join(root, name), exist_ok=True)
    for name in metadata_dir:
        os.makedirs(os.path.join(root, name, ".metadata"), exist_ok=True)
    for name in files:
        open(os.path.join(root, name), "wb").close()


LAYOUTS = {
    "empty": {},
    "numeric_order": {"complete": ("global_step_2", "global_step_10"), "incomplete": ("global_step_30",)},
    "junk_names": {"complete": ("global_step_3", "global_step_7x", "step_99", "global_step_"),
                   "files": ("global_step_99",)},
    "metadata_is_a_dir": {"complete": ("global_step_1",), "metadata_dir": ("global_step_5",)},
    "step_zero_only": {"complete": ("global_step_0",)},
    "leading_zeros": {"complete": ("global_step_08",), "incomplete": ("global_step_8",)},
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_find_latest_is_veomnis_get_checkpoint_path(tmp_path, layout):
    """On a root named ``checkpoints`` (VeOmni's ``<output_dir>/checkpoints``), the adapter's
    ``find_latest_checkpoint(root)`` is exactly ``get_checkpoint_path(output_dir, ..., "dcp")``."""
    from veomni.utils.checkpoint_utils import get_checkpoint_path

    root = str(tmp_path / "out" / "checkpoints")
    _layout(root, **LAYOUTS[layout])
    assert VeOmni().find_latest_checkpoint(root) == get_checkpoint_path(str(tmp_path / "out"), True, "dcp")


def test_find_latest_on_any_root_name(tmp_path):
    ck = VeOmni()
    assert ck.find_latest_checkpoint(str(tmp_path / "missing")) is None
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    _layout(str(tmp_path), **LAYOUTS["numeric_order"])
    assert ck.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_10")


# -- evidence of VeOmni defects ----------------------------------------------------------------


def defect(reason: str):
    """A test that shows a defect of VeOmni: it fails (an ``AssertionError``) while the defect is
    there; strict, so a VeOmni that fixes it turns the test into a failure that says so."""
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason="VeOmni defect: " + reason)


@defect("its FileSystemWriter(thread_count=16) runs DCP's extra writer threads, whose exceptions DCP "
        "drops (_write_files_from_queue only catches queue.Empty; _write_data joins the threads and "
        "returns what the others wrote): an ENOSPC in one of them is acknowledged, .metadata is "
        "committed, and the step cannot be loaded (KeyError in read_data)")
def test_veomni_defect_a_failed_shard_write_is_acknowledged(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.failed_worker_write, str(tmp_path))[0]
    assert r["injected"], "no writer thread took a shard file: the fault was not injected"
    assert r["save_error"] is not None or r["latest"] is None, (
        f"the save was acknowledged and {r['latest']} is found as complete; resuming from it: "
        f"{r['resume'].get('error') or r['resume']}")


@defect("_load_extra_state reads extra_state_rank_<r>.pt with torch.load(weights_only=False): loading a "
        "checkpoint runs code its bytes name")
def test_veomni_defect_load_executes_code_from_the_extra_state(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.code_from_extra_state, str(tmp_path))[0]
    assert not r["executed"], f"the pickled call ran during load (load returned {r})"


@defect("DistributedCheckpointer.save persists only state['model'] and state['optimizer'] (and extra "
        "state); any other entry, e.g. fp32_main_params, is dropped without an error although "
        "CheckpointerBase.save documents state as 'objects to persist'")
def test_veomni_defect_other_state_entries_are_dropped(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.dropped_entries, str(tmp_path))[0]
    assert any(k.startswith("fp32_main_params.") for k in r["keys"]), f"saved DCP keys: {r['keys']}"
    assert r["digest"] == r["reference"]


@defect("_load_extra_state calls os.makedirs(<step>/extra_state) before reading: a load writes into the "
        "checkpoint it reads")
def test_veomni_defect_load_writes_into_the_checkpoint(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.load_writes, str(tmp_path))[0]
    assert "FileNotFoundError" in (r["error"] or "")
    assert not r["created"], "load created <step>/extra_state"


@defect("get_checkpoint_path's 'if not iteration' treats a complete global_step_0 as no checkpoint")
def test_veomni_defect_step_zero_is_never_found(tmp_path):
    _layout(str(tmp_path), complete=("global_step_0",))
    assert VeOmni().find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_0")


@defect("_validate_dcp_checkpoint_entry parses the step with int() (leading zeros, '+', '_', spaces pass) "
        "and get_checkpoint_path rebuilds the name from the number: a complete global_step_08 yields "
        "global_step_8, an incomplete directory")
def test_veomni_defect_the_path_found_is_not_the_directory_validated(tmp_path):
    _layout(str(tmp_path), complete=("global_step_08",), incomplete=("global_step_8",))
    found = VeOmni().find_latest_checkpoint(str(tmp_path))
    assert found is None or os.path.isfile(os.path.join(found, ".metadata")), f"{found} has no .metadata"


@pytest.mark.skipif(ACCELERATOR, reason="VeOmni's device helpers have empty_cache on an accelerator host")
@defect("on a host without CUDA/NPU/MLU, a sync save raises AttributeError (torch.cpu.empty_cache) after "
        "dcp.save has committed the step: the save the caller saw fail is the one a restart resumes from")
def test_veomni_defect_a_sync_save_that_raised_is_resumed_from(world_factory, tmp_path):
    r = world_factory.get(1).run(fns.sync_save, str(tmp_path))[0]
    if r["error"] is not None and "torch.cpu' has no attribute 'empty_cache'" not in r["error"]:
        pytest.fail(f"the sync save raised something else: {r['error']}")
    assert r["error"] is None or r["path"] is None, (
        f"save raised {r['error']!r}, yet {r['path']} is found and resumes bitwise: {r['digest'] == r['reference']}")
