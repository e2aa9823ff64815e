"""Fixtures shared by the single-process refckpt tests (test_hostile.py, test_integrity.py,
test_layout.py, test_optim.py, test_cli.py and the single-process part of test_checkpointer_world.py)."""

from __future__ import annotations

import shutil
import warnings

import pytest

from . import _builders as B


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A root with complete steps 4 and 42 (per-rank extra state {"global_step": N}), built once
    per module, and the parameters each step holds."""
    root = tmp_path_factory.mktemp("template") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, p4, _ = B.save_trained(root, 4, seed=1)
        _, p42, _ = B.save_trained(root, 42, seed=2)
    return root, {4: p4, 42: p42}


@pytest.fixture
def ckpt(template, tmp_path):
    """A private copy of ``template``: (root, step 4 dir, step 42 dir), free to damage."""
    root = tmp_path / "ckpt"
    shutil.copytree(template[0], root, symlinks=True)
    return str(root), str(root / "global_step_4"), str(root / "global_step_42")


@pytest.fixture
def quiet_single_process_warnings():
    """DCP's 'no process group, single process' notice and torch's pickle-protocol notice, which
    every single-process save and load here triggers; other warnings stay visible."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield
