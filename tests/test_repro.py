"""``python -m faults repro`` (faults/repro.py, issue 28): a finding as a standalone script that needs
torch and the checkpointer only, exits 1 while the defect is present and 0 once it is gone.

The default run keeps one fast test: a recording made in this process (the recording proxy around a
tiny checkpointer written here, a broken and a correct one) becomes a script, which is run against
both. The end-to-end reproductions -- one finding of each peer, through the real command, the real
suite and the real packages, then the same script on refckpt -- are ``extended`` (about 30-60 s each).
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch

from faults import repro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORRECT = "refckpt:DistributedCheckpointer"

TINY = textwrap.dedent('''\
    """A checkpointer of the contract in a few lines: torch.save of the whole state plus a commit record.
    ``broken()``'s find-latest trusts the commit record alone (as plain DCP's documented loop does)."""
    import os

    import torch


    class Tiny:
        capabilities = ()

        def __init__(self, trust_record_only=False):
            self.trust_record_only = trust_record_only

        def save(self, path, state, *, global_step, save_async=False):
            os.makedirs(path, exist_ok=True)
            torch.save(state, os.path.join(path, "state.pt"))
            with open(os.path.join(path, ".metadata"), "w") as f:
                f.write(str(global_step))

        def load(self, path, state, *, strict_model=True, extra_state_skeleton=None):
            saved = torch.load(os.path.join(path, "state.pt"), weights_only=False)
            for k, t in state["model"].items():
                t.copy_(saved["model"][k])
            if extra_state_skeleton is not None:
                state["extra_state"] = saved["extra_state"]
            return state

        def find_latest_checkpoint(self, root):
            def complete(d):
                return os.path.exists(os.path.join(d, ".metadata")) and (
                    self.trust_record_only or os.path.exists(os.path.join(d, "state.pt")))
            steps = [int(n.split("_")[-1]) for n in os.listdir(root) if n.startswith("global_step_")
                     and complete(os.path.join(root, n))] if os.path.isdir(root) else []
            return os.path.join(root, f"global_step_{max(steps)}") if steps else None

        def maybe_wait_for_async_save(self):
            pass

        def raise_for_failed_async_save(self):
            pass


    def make():
        return Tiny()


    def broken():
        return Tiny(trust_record_only=True)
    ''')


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
            "extra_state": {"global_step": step}}


def _imports(script: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_a_recorded_episode_becomes_a_script_that_fails_the_broken_checkpointer_only(tmp_path, monkeypatch, capsys):
    """Record a resume past a step whose payload the harness deleted (the proxy of
    ``faults.training.load_factory`` in this process), write the script, run it: 1 against the
    checkpointer that trusts the commit record alone, 0 with ``--checkpointer`` naming the one that
    checks the payload too; the script imports nothing from faults."""
    (tmp_path / "tiny_ckpt.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    rec_dir, root = tmp_path / "rec", tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv(repro.ENV_RECORD, str(rec_dir))
    from faults.contract import capabilities_of
    from faults.training import load_factory

    factory = load_factory("tiny_ckpt:broken")  # the hook: a recording factory
    assert type(factory).__name__ == "_RecordingFactory" and capabilities_of(factory) == frozenset()
    ck = factory()
    for step in (1, 2):
        ck.save(str(root / f"global_step_{step}"), _state(step), global_step=step)
    os.unlink(root / "global_step_2" / "state.pt")  # the harness, between calls
    ck2 = factory()
    path = ck2.find_latest_checkpoint(str(root))
    target = _state(0)
    skeleton = target.pop("extra_state")
    with pytest.raises(FileNotFoundError) as e:
        ck2.load(path, target, extra_state_skeleton=skeleton)
    # how the test failed: the load's error in its message (found by text, as for a forked child's)
    (rec_dir / "result.json").write_text(json.dumps({
        "nodeid": "test_tiny[tiny_ckpt:broken]", "outcome": "failed",
        "message": f"resume failed: find_latest_checkpoint chose {path}, and load raised FileNotFoundError: {e.value}"}))

    ep, found, result = repro.load_episode(str(rec_dir))
    assert [n for n, _ in found] == [3, 4], found  # find-latest named the damaged step; the load raised
    assert "deleted global_step_2/state.pt" in found[0][1] and "global_step_1" in found[0][1], found
    script = repro.script_for(ep, found, result, "tiny_ckpt:broken")
    assert not [m for m in _imports(script) if m.split(".")[0] in ("faults", "") or m.startswith(".")], _imports(script)
    (tmp_path / "repro_tiny.py").write_text(script)
    main = runpy.run_path(str(tmp_path / "repro_tiny.py"), run_name="repro_tiny")["main"]
    capsys.readouterr()

    assert main([]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION: find_latest_checkpoint returned global_step_2" in out, out
    assert "the exception that failed the suite's test" in out, out
    assert "DEFECT PRESENT" in out and "the recorded defect, observed again" in out, out

    assert main(["--checkpointer", "tiny_ckpt:make"]) == 0
    out = capsys.readouterr().out
    assert "mode mapped" in out and "returned '<root>/global_step_1'" in out, out
    assert "VIOLATION" not in out and "NOT REPRODUCED" in out, out


def test_selection_and_help(capsys):
    """NODEID as docs/audit.md lists it (the checkpointer's parameter left out) or as pytest spells it."""
    name = "test_x[faults.adapters.dcp:PlainDCP-missing_payload]"
    assert repro._short_name(name) == "test_x[missing_payload]"
    assert repro._short_name("test_y[faults.adapters.dcp:PlainDCP]") == "test_y"
    assert repro._matches(name, "test_contract", "test_x[missing_payload]")
    assert repro._matches(name, "test_contract", f"faults/suite/test_contract.py::{name}")
    assert repro._matches(name, "test_contract", "faults.suite.test_contract::test_x[missing_payload]")
    assert not repro._matches(name, "test_contract", "test_integrity.py::test_x[missing_payload]")
    assert not repro._matches(name, "test_contract", "test_x[missing_commit]")
    with pytest.raises(SystemExit) as e:
        repro.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Exit codes" in out and "--checkpointer" in out


def test_an_adapter_is_inlined_without_faults():
    """plain DCP's adapter, its imports from faults replaced by copies: it compiles, imports nothing
    from faults, and builds a checkpointer."""
    src, name = repro._inline_adapter("faults.adapters.dcp:PlainDCP")
    assert name == "PlainDCP"
    assert not [m for m in _imports(src) if m.split(".")[0] == "faults" or m.startswith(".")], _imports(src)
    ns: dict = {}
    exec(compile("from __future__ import annotations\n" + src, "<inlined>", "exec"), ns)  # noqa: S102
    ck = ns["FACTORY"]()
    assert type(ck).__name__ == "PlainDCP" and ns["step_of"]("global_step_12") == 12


# -- one finding of each peer, end to end (extended) ---------------------------------------------------

PEERS = {
    # plain DCP: no checksums, a flipped payload bit loads as another state
    "dcp": ("faults.adapters.dcp:PlainDCP", "torch", "test_corrupt_payload_never_loads_silently",
            ["VIOLATION: load of global_step_2 returned without an error although the step was damaged",
             "flipped 1 bit(s) of global_step_2/__0_0.distcp"],
            "raised refckpt.errors.CorruptCheckpointError"),
    # torchtitan: _find_load_step trusts .metadata, so resume stops at a step whose payload is gone
    "torchtitan": ("faults.adapters.torchtitan:TorchTitan", "torchtitan",
                   "test_each_kind_of_damage_falls_back_to_the_previous_step[missing_payload]",
                   ["VIOLATION: find_latest_checkpoint returned global_step_2",
                    "the newest acknowledged, intact step is global_step_1"],
                   "returned '<root>/global_step_1'"),
    # VeOmni: save keeps only model and optimizer; the fp32 main parameters come back as they were
    "veomni": ("faults.adapters.veomni:VeOmni", "veomni", "test_multi_rank_round_trip[w1-async-bf16_main_fp32]",
               ["VIOLATION: load of global_step_3 returned a state that differs from the one saved at step 3",
                "fp32_main_params.embed.weight", "never restored: still the load target's own value"],
               "returned a state"),
}
_NO_CHECKSUMS = ("test_corrupt_payload_never_loads_silently",
                 ["VIOLATION: load of global_step_2 returned without an error although the step was damaged",
                  "flipped 1 bit(s) of global_step_2/"],
                 # refckpt has no file of that name (one file per step there): the mapped replay says the flip
                 # was not applied, and the correct checkpointer's run of the script exits 0
                 "not applied: flip global_step_2/")
# the checkpointers most people train with: no checksums, a flipped bit loads as another state
PEERS.update({
    "torchsave": ("faults.adapters.torchsave:TorchSave", "torch", *_NO_CHECKSUMS),
    "lightning": ("faults.adapters.lightning:LightningFabric", "lightning", *_NO_CHECKSUMS),
    "lightning-trainer": ("faults.adapters.lightning_trainer:LightningTrainer", "lightning", *_NO_CHECKSUMS),
    "deepspeed": ("faults.adapters.deepspeed:DeepSpeed", "deepspeed", *_NO_CHECKSUMS),
})


@pytest.mark.extended
@pytest.mark.parametrize("peer", list(PEERS))
def test_a_finding_of_each_peer_reproduces_standalone_and_not_on_refckpt(tmp_path, peer):
    """The command records the finding, writes the script and runs it with faults hidden (it must
    exit 1: the command's own exit 0 says so); the script's output names the defect; the same script
    replaying the episode on refckpt (mapped mode) exits 0."""
    spec, package, nodeid, defect, on_refckpt = PEERS[peer]
    pytest.importorskip(package)
    script = tmp_path / f"repro_{peer}.py"
    p = subprocess.run([sys.executable, "-m", "faults", "repro", nodeid, "--checkpointer", spec, "-o", str(script)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "exited 1" in out and "DEFECT PRESENT" in out, out[-4000:]
    for text in defect:
        assert text in out, (text, out[-4000:])
    text = script.read_text()
    assert not [m for m in _imports(text) if m.split(".")[0] == "faults" or m.startswith(".")]

    env = repro.hidden_faults_env(str(tmp_path))
    fixed = subprocess.run([sys.executable, str(script), "--checkpointer", CORRECT], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-2000:]
    assert "NOT REPRODUCED" in fixed.stdout and on_refckpt in fixed.stdout, fixed.stdout[-3000:]
    assert "VIOLATION" not in fixed.stdout, fixed.stdout[-3000:]
