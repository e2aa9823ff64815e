"""``faults.adapters.deepspeed:DeepSpeed``: DeepSpeed 0.19.8's ``engine.save_checkpoint`` /
``engine.load_checkpoint`` behind the harness contract, on DeepSpeed's CPU accelerator with gloo.

The default run checks the import path, the declarations and ``find_latest_checkpoint`` (DeepSpeed's
``latest`` file, no engine). Everything that builds an engine is in the extended profile: an
engine costs more than this file's share of ``pytest -n 8``. The adapter keeps DeepSpeed from
JIT-compiling its CPU shared-memory op (``test_a_stale_build_lock_does_not_stall_an_engine``).

``deepspeed`` is imported by the fixture below, not at collection."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from faults.adapters import Unavailable
from faults.contract import Checkpointer, Limitation, capabilities_of, limitations_of
from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, load_factory
from tests import _plain_adapter_fns as fns
from tests._adapter_checks import extra_state_only_with_a_skeleton

SPEC = "faults.adapters.deepspeed:DeepSpeed"
INSTALL = ("DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation 'deepspeed==0.19.8' && pip install "
           "hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 psutil py-cpuinfo==9.0.0 ninja==1.13.2")
adapter: Any = None


@pytest.fixture(scope="module", autouse=True)
def _deepspeed() -> None:
    global adapter
    adapter = pytest.importorskip("faults.adapters.deepspeed", exc_type=ImportError,
                                  reason=f"faults.adapters.deepspeed cannot be imported ({INSTALL})")


# One xdist worker for the module: DeepSpeed's import (and its op probe) costs about 2 CPU s in the worker, so
# spread over `pytest -n 8`'s workers it was paid once per worker and per world.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning"),
              pytest.mark.xdist_group("peer-deepspeed")]

CFG = RunConfig(ModelSpec(tied=True, frozen=True, unused=True), OptimSpec(("adamw", "sgd_momentum")),
                extra_per_rank=False)


def test_factory_declares_limitations_only_and_follows_the_protocol():
    factory = load_factory(SPEC)
    assert factory is adapter.DeepSpeed
    assert capabilities_of(factory) == frozenset()
    assert limitations_of(factory) == {Limitation.SYNC_ONLY, Limitation.PLAIN_TENSORS_ONLY,
                                       Limitation.NO_COMMIT_RECORD, Limitation.NO_POINTER}
    assert isinstance(factory(), Checkpointer)
    assert adapter.PACKAGE == "deepspeed"


def test_find_latest_is_deepspeeds_latest_file(tmp_path):
    """What ``load_checkpoint(root, tag=None)`` does: the tag in ``root/latest``, stripped, whether
    or not that directory exists; no ``latest``, no step (whatever directories there are)."""
    ck = adapter.DeepSpeed()
    assert ck.find_latest_checkpoint(str(tmp_path / "missing")) is None
    (tmp_path / "global_step_5").mkdir()
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest").write_text("global_step_3\n")
    assert ck.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_3")  # not looked at
    (tmp_path / "latest").write_text("")
    assert ck.find_latest_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "")


def test_missing_deepspeed_raises_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.delitem(sys.modules, "faults.adapters.deepspeed")
    with pytest.raises(Unavailable, match=r"deepspeed==0\.19\.8.*--no-build-isolation 'deepspeed==0\.19\.8'"):
        importlib.import_module("faults.adapters.deepspeed")


#: A save and a load through the adapter in a fresh interpreter (a fresh ``deepspeed.ops`` probe),
#: importing this checkout whatever the working directory.
_FRESH_SAVE = f"""
import os, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
from tests import _plain_adapter_fns as fns
from faults.training import ModelSpec, OptimSpec, RunConfig
cfg = RunConfig(ModelSpec(), OptimSpec(("adamw",)), extra_per_rank=False)
r = fns.round_trip({SPEC!r}, sys.argv[1], cfg, steps=(1,), save_async=(False,))
assert r["digest"] == r["reference"], "not bitwise"
print("round trip ok")
"""


@pytest.mark.extended
def test_a_stale_build_lock_does_not_stall_an_engine(tmp_path):
    """DeepSpeed's communication backend JIT-compiles its CPU shared-memory op on the first engine of
    a machine, under a lock file in the torch extensions folder; a process killed during that build
    (the suite kills ranks) leaves the lock, and every later engine waits on it forever
    (``torch.utils.file_baton``: a CI run hung so). The adapter never builds the op: a fresh process
    whose extensions folder holds such a stale lock saves and loads in bounded time, and builds
    nothing there."""
    ext = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    env.pop("PYTHONPATH", None)
    probe = "from torch.utils.cpp_extension import _get_build_directory as d; print(d('deepspeed_shm_comm', False))"
    build = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True)
    lock = Path(build.stdout.strip()) / "lock"
    assert lock.parent.is_dir() and lock.parent.is_relative_to(ext)
    lock.touch()  # what a build killed before it finished leaves behind
    p = subprocess.run([sys.executable, "-c", _FRESH_SAVE, str(tmp_path / "ckpt")], env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0 and "round trip ok" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(q.name for q in lock.parent.iterdir()) == ["lock"], "the op was built"


@pytest.mark.extended
def test_one_process_round_trip_is_bitwise(tmp_path):
    """Two steps, DeepSpeed's own layout (``<root>/<tag>/mp_rank_00_model_states.pt`` and
    ``<root>/latest``), the newest found through ``latest`` and loaded bitwise; extra state only
    with a skeleton; ``strict_model`` is ``load_module_strict``. Also across a replaced default
    group (the test's 1-rank group is destroyed and made again in between)."""
    from faults.adapters import release_process_group

    local_rank = os.environ.get("LOCAL_RANK")
    r = fns.round_trip(SPEC, str(tmp_path), CFG)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["listing"] == ["global_step_2", "global_step_3", "latest"]
    assert os.listdir(r["path"]) == ["mp_rank_00_model_states.pt"]
    assert (tmp_path / "latest").read_text() == "global_step_3"
    assert r["same_dict"] and r["step"] == 3 and r["digest"] == r["reference"]
    release_process_group()
    extra_state_only_with_a_skeleton(adapter.DeepSpeed(), r["path"], CFG, 3)
    state = TrainRun(CFG).state(target=True)
    state["model"]["not_in_checkpoint"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"not_in_checkpoint\""):
        adapter.DeepSpeed().load(r["path"], state)
    adapter.DeepSpeed().load(r["path"], state, strict_model=False)
    assert os.environ.get("LOCAL_RANK") == local_rank  # set only while DeepSpeed builds an engine


@pytest.mark.extended
def test_two_rank_round_trip(world_factory, tmp_path):
    results = world_factory.get(2).run(fns.round_trip, SPEC, str(tmp_path), CFG)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"
