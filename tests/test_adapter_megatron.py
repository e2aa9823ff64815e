"""``faults.adapters.megatron:MegatronCore``: Megatron-Core 0.16.1's ``dist_checkpointing.save`` /
``load`` behind the harness contract.

Megatron-Core's ``torch_dist`` save strategy calls ``torch.cuda.synchronize()`` and makes a tensor
on ``torch.cuda.current_device()``, so on a host without CUDA the adapter is :class:`Unavailable`
with that error (the audit then skips it with the reason); the round trip runs where CUDA is.

``megatron.core`` is imported by the tests, not at collection (about 3.5 CPU s): the test of the
host without CUDA is in the extended profile; the default run checks the import path only."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from faults.adapters import Unavailable
from faults.training import ModelSpec, OptimSpec, RunConfig
from tests import _plain_adapter_fns as fns

SPEC = "faults.adapters.megatron:MegatronCore"
INSTALL = "pip install --no-deps 'megatron-core==0.16.1'"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


def _megatron_installed() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        pytest.skip(f"megatron-core is not installed ({INSTALL}): {e}")


@pytest.mark.extended  # importing megatron.core costs about 3.5 CPU s, more than this file's share of `pytest -n 8`
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the adapter is available here")
def test_without_cuda_the_adapter_is_unavailable_with_megatrons_error():
    _megatron_installed()
    sys.modules.pop("faults.adapters.megatron", None)
    with pytest.raises(Unavailable) as e:
        importlib.import_module("faults.adapters.megatron")
    msg = str(e.value)
    assert "torch.cuda.synchronize()" in msg and "FileSystemWriterAsync.preload_tensors" in msg
    assert "AssertionError: Torch not compiled with CUDA enabled" in msg or "RuntimeError" in msg


def test_missing_megatron_raises_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    monkeypatch.delitem(sys.modules, "faults.adapters.megatron", raising=False)
    with pytest.raises(Unavailable, match=r"megatron-core==0\.16\.1.*pip install --no-deps 'megatron-core==0\.16\.1'"):
        importlib.import_module("faults.adapters.megatron")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron-Core's torch_dist save needs CUDA "
                    "(torch.cuda.synchronize, torch.cuda.current_device); this host has none")
def test_one_process_round_trip_is_bitwise(tmp_path):
    adapter = pytest.importorskip("faults.adapters.megatron", exc_type=ImportError, reason=INSTALL)
    from faults.contract import Limitation, capabilities_of, limitations_of

    assert capabilities_of(adapter.MegatronCore) == frozenset()
    assert limitations_of(adapter.MegatronCore) == {Limitation.SYNC_ONLY, Limitation.PLAIN_TENSORS_ONLY,
                                                    Limitation.NO_POINTER}
    cfg = RunConfig(ModelSpec(tied=True), OptimSpec(("adamw", "sgd_momentum")), extra_per_rank=False)
    r = fns.round_trip(SPEC, str(tmp_path), cfg)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert "metadata.json" in os.listdir(r["path"]) and "common.pt" in os.listdir(r["path"])
    assert r["same_dict"] and r["step"] == 3 and r["digest"] == r["reference"]
