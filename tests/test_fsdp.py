"""FSDP2 (``fully_shard``) resharding with refckpt in real gloo worlds on CPU.

Acceptance: FSDP2 state saved at world size 2 loads at world sizes 1, 2 and 4 with a
bitwise-equal full state (parameters, every AdamW moment incl. ``max_exp_avg_sq``,
``step``, param-group hyperparameters); state dicts from torch's ``get_state_dict``
work as they are; training resumed after a load is bitwise an uninterrupted run.

The reference ("full state") is torch's own ``get_state_dict(full_state_dict=True,
cpu_offload=True)`` gathered on rank 0, independent of refckpt. Worlds come from
``world_factory`` and are reused; each checkpoint is saved once per module and loaded
by several tests (loads do not change it).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _fsdp_fns as fns

# One worker runs them all: they share the checkpoints saved once at world size 2.
pytestmark = pytest.mark.xdist_group("faults-fsdp")

LOAD_WORLD_SIZES = [1, 2, 4]
SAVE_WORLD_SIZE = 2
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def assert_full_equal(saved: dict, got: dict, where: str) -> None:
    """Bitwise: every parameter, every optimizer state entry, every param-group field."""
    assert sorted(got["model"]) == sorted(saved["model"]), where
    for k, v in saved["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape, f"{where}: model {k}"
        assert torch.equal(g, v), f"{where}: model {k} differs (max |d| {(g - v).abs().max().item()})"
    so, go = saved["optimizer"], got["optimizer"]
    assert sorted(go["state"]) == sorted(so["state"]), where
    for fqn, st in so["state"].items():
        assert sorted(go["state"][fqn]) == sorted(st), f"{where}: optimizer state keys of {fqn}"
        for k, v in st.items():
            g = go["state"][fqn][k]
            assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and g.shape == v.shape, f"{where}: {fqn}.{k}"
            assert torch.equal(g, v), f"{where}: optimizer {fqn}.{k} differs"
    assert go["param_groups"] == so["param_groups"], f"{where}: param_groups differ"


def check_saved_is_meaningful(saved: dict) -> None:
    """The reference holds what the test claims to compare: amsgrad moments, step 3, non-zero."""
    st = saved["optimizer"]["state"]
    assert sorted(st) == sorted(saved["model"])
    for fqn, s in st.items():
        assert set(MOMENTS) <= set(s), (fqn, sorted(s))
        assert s["step"].item() == fns.SAVE_STEP
        assert s["exp_avg"].abs().sum() > 0 and s["max_exp_avg_sq"].abs().sum() > 0
    (g,) = saved["optimizer"]["param_groups"]
    assert g["amsgrad"] is True and g["lr"] == 1e-2 and g["weight_decay"] == 0.1


def expected_local(dims, world: int) -> dict[str, tuple[int, ...]]:
    """FSDP2 shards dim 0 in torch.chunk pieces; report rank ``world-1``'s (the last, shortest)."""
    i, h, o = dims

    def last(n):
        sizes = [c.shape[0] for c in torch.empty(n).chunk(world)]
        sizes += [0] * (world - len(sizes))
        return sizes[-1]

    return {"0.weight": (last(h), i), "0.bias": (last(h),), "2.weight": (last(o), h), "2.bias": (last(o),)}


class Saved:
    """Checkpoints saved once (lazily) at world size 2, shared by the tests of this module."""

    def __init__(self, factory, tmp_factory) -> None:
        self._factory, self._tmp, self._cache = factory, tmp_factory, {}

    def get(self, save_async: bool = False, *, per_rank: bool = False, dims=(fns.IN, fns.HIDDEN, fns.OUT),
            use_refckpt_state: bool = True):
        key = (save_async, per_rank, dims, use_refckpt_state)
        if key not in self._cache:
            root = self._tmp.mktemp("fsdp_ckpt")
            results = self._factory.get(SAVE_WORLD_SIZE).run(
                fns.save_fsdp, str(root), save_async, per_rank=per_rank, dims=dims,
                use_refckpt_state=use_refckpt_state)
            assert all(r["dtensor"] == {"model": True, "moments": True} for r in results), \
                "the saved state dict is not FSDP2/DTensor-sharded"
            assert results[-1]["local"] == expected_local(dims, SAVE_WORLD_SIZE)
            assert all(r["full"] is None for r in results[1:])
            saved = results[0]["full"]
            check_saved_is_meaningful(saved)
            self._cache[key] = (str(root), saved)
        return self._cache[key]


@pytest.fixture(scope="module")
def saved(world_factory, tmp_path_factory) -> Saved:
    return Saved(world_factory, tmp_path_factory)


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("load_world", LOAD_WORLD_SIZES)
def test_fsdp2_reshard_load_is_bitwise(world_factory, saved, load_world, save_async):
    root, full = saved.get(save_async)
    step_dir = os.path.join(root, "global_step_3")
    shards = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    assert shards == [f"__{r}_0.safetensors" for r in range(SAVE_WORLD_SIZE)]
    results = world_factory.get(load_world).run(fns.load_full, root)
    for rank, r in enumerate(results):
        assert r["path"] == step_dir, rank
        assert r["extra"] == {"global_step": fns.SAVE_STEP}, rank
    # the loading model really is sharded at the new world size
    assert results[-1]["local"] == expected_local((fns.IN, fns.HIDDEN, fns.OUT), load_world)
    assert_full_equal(full, results[0]["full"], f"saved at 2 ({'async' if save_async else 'sync'}), loaded at {load_world}")


@pytest.mark.parametrize("load_world", [1, 2, 4])
def test_torch_get_state_dict_as_is(world_factory, saved, load_world):
    """torch's get_state_dict/set_state_dict output, not refckpt's helpers, on both sides."""
    root, full = saved.get(use_refckpt_state=False)
    results = world_factory.get(load_world).run(fns.load_full, root, use_refckpt_state=False)
    assert all(r["extra"] == {"global_step": fns.SAVE_STEP} for r in results)
    assert_full_equal(full, results[0]["full"], f"get_state_dict as is, loaded at {load_world}")


@pytest.mark.parametrize("load_world", [1, 2])
def test_fsdp2_checkpoint_loads_into_plain_module(world_factory, saved, load_world):
    """Sharded (DTensor) save, plain (replicated, unwrapped) load: DCP stores global tensors."""
    root, full = saved.get()
    results = world_factory.get(load_world).run(fns.load_full, root, shard=False)
    assert results[-1]["local"] == {"0.weight": (16, 8), "0.bias": (16,), "2.weight": (8, 16), "2.bias": (8,)}
    assert_full_equal(full, results[0]["full"], f"plain module at {load_world}")


@pytest.mark.parametrize("load_world", [1, 4])
def test_fsdp2_uneven_shards_reshard(world_factory, saved, load_world):
    """Dims that 2 and 4 do not divide: FSDP2 pads the last shards (rank 3 of 4 holds 0 rows)."""
    root, full = saved.get(dims=fns.UNEVEN)
    results = world_factory.get(load_world).run(fns.load_full, root, dims=fns.UNEVEN)
    assert results[-1]["local"] == expected_local(fns.UNEVEN, load_world)
    assert_full_equal(full, results[0]["full"], f"uneven dims {fns.UNEVEN}, loaded at {load_world}")


def test_per_rank_extra_state_cannot_change_the_world_size(world_factory, saved):
    """Per-rank extra state saved by 2 ranks has nothing for ranks 2 and 3 of 4, and at 1 rank
    restoring rank 0's alone would silently drop rank 1's data position and RNG stream.

    That is not damage: every rank raises the same non-fallback error (no hang, no
    "restore from a copy"), and the model and optimizer still reshard without extra state.
    """
    root, full = saved.get(per_rank=True)
    same = world_factory.get(2).run(fns.load_full, root)
    assert all(r["extra"] == {"global_step": fns.SAVE_STEP} for r in same)
    assert_full_equal(full, same[0]["full"], "per-rank extra state, same world size")

    for other in (4, 1):
        changed = world_factory.get(other).run(fns.load_full, root, expect_error=True)
        for rank, r in enumerate(changed):
            err = r.get("error", "")
            assert err.startswith("MissingTrainingStateError") and "cannot be resharded" in err, (other, rank, r)

    weights = world_factory.get(4).run(fns.load_full, root, with_extra=False)
    assert all(r["extra"] is None for r in weights)
    assert_full_equal(full, weights[0]["full"], "per-rank checkpoint without extra state, at 4")


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_resume_matches_uninterrupted_run(world_factory, tmp_path, save_async):
    results = world_factory.get(SAVE_WORLD_SIZE).run(fns.resume_vs_uninterrupted, str(tmp_path), save_async)
    assert all(r["path"] == str(tmp_path / "global_step_3") for r in results)
    r = results[0]
    assert_full_equal(r["uninterrupted"], r["resumed"], "resumed after 3 steps vs 5 uninterrupted steps")
    assert all(s["step"].item() == fns.TOTAL_STEPS for s in r["resumed"]["optimizer"]["state"].values())


def test_each_shards_safetensors_header_agrees_with_the_commit_record(saved):
    """The shard files are safetensors files on their own (DCP's HuggingFaceStorageReader and
    `safetensors` read them without refckpt): each header's ``DCP_SHARDING_INFO`` names, for every
    tensor, the offsets of the chunk the commit record stores there, and its byte ranges are the
    record's. refckpt's own load reads the record only, so nothing else checks the header
    (issue 29: mutants that wrote zero offsets, or renamed the key, survived every test)."""
    import json
    import struct

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from refckpt.layout import check_step_dir
    from refckpt.storage import BYTES_KEY_PREFIX

    root, _full = saved.get()
    step_dir = os.path.join(root, "global_step_3")
    md = check_step_dir(step_dir).metadata
    by_file: dict[str, dict[tuple, tuple[int, int]]] = {}
    for idx, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, {})[(idx.fqn, tuple(idx.offset or ()))] = (info.offset, info.length)
    nonzero = 0
    for rel, items in by_file.items():
        if not rel.endswith(".safetensors"):
            continue
        with open(os.path.join(step_dir, rel), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for (fqn, offsets), (off, length) in items.items():
            if isinstance(md.state_dict_metadata[fqn], BytesStorageMetadata):  # non-tensor items: a prefixed key
                keys = [BYTES_KEY_PREFIX + fqn] if BYTES_KEY_PREFIX + fqn in header else []
            else:
                keys = [k for k in (fqn, f"{fqn}@{','.join(map(str, offsets))}") if k in header]
            assert keys, f"{rel}: no header entry for {fqn} at {offsets}"
            entry = header[keys[0]]
            is_bytes = keys[0].startswith(BYTES_KEY_PREFIX)
            assert sharding[keys[0]]["saved_offsets"] == ([0] if is_bytes else list(offsets)), f"{rel}: {fqn}"
            start = 8 + n
            assert [start + b for b in entry["data_offsets"]] == [off, off + length], f"{rel}: {fqn} byte range"
            nonzero += any(offsets)
    assert nonzero > 0, "no chunk with a non-zero offset: the check saw no sharding"
