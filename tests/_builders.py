"""Shared helpers for the single-process tests: tiny models, optimizers, deterministic
training, bitwise comparison, and byte-level surgery on checkpoint files.

Everything here is deterministic from seeds, so two calls with the same arguments build
bitwise-identical objects; tests use that to compare a resumed run with an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import signal
import struct
from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import torch

import refckpt
from refckpt import DistributedCheckpointer, get_training_state, set_training_state
from refckpt.layout import MANIFEST_ATTR, METADATA_FILE
from refckpt.record import encode_record
from refckpt.safeload import load_metadata

SHARD = "__0_0.safetensors"
EXTRA_REL = "extra_state/extra_state_rank_0.pt"

OptFactory = Callable[[Any], torch.optim.Optimizer]

#: name -> factory(params) of every optimizer configuration the tests exercise.
OPTIMIZERS: dict[str, OptFactory] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, weight_decay=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1, weight_decay=1e-3),
}


def make_model(seed: int = 0, hidden: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


def make(seed: int = 0, kind: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    return model, OPTIMIZERS[kind](model.parameters())


def batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 + step))


def train(model: torch.nn.Module, opts: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], steps: range) -> None:
    """Deterministic training: the batch of step ``s`` depends on ``s`` only."""
    opts = [opts] if isinstance(opts, torch.optim.Optimizer) else list(opts)
    for s in steps:
        for o in opts:
            o.zero_grad(set_to_none=True)
        model(batch(s)).pow(2).mean().backward()
        for o in opts:
            o.step()


def clone_tree(obj: Any) -> Any:
    """A deep copy in which every tensor is an independent clone (a snapshot kept before a save)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """Recursively assert two trees are equal, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: tensors differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b)}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def opt_snapshot(opt: torch.optim.Optimizer) -> dict:
    return clone_tree(opt.state_dict())


def fresh_state(seed: int = 99, kind: str = "adamw"):
    """A fresh (untrained) model and optimizer and their training state, empty extra state
    included, ready to be loaded into: ``(model, opt, state)``."""
    model, opt = make(seed, kind)
    return model, opt, get_training_state(model, opt, {})


def oserror(code: int, path: str = "") -> OSError:
    """``OSError(code)`` as the operating system raises it (message and file name filled in)."""
    return OSError(code, os.strerror(code), path)


def torch_saved(obj: Any) -> bytes:
    """The bytes ``torch.save(obj)`` writes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def state_of(model, opts, extra: dict | None = None) -> dict:
    return get_training_state(model, opts, extra)


def save(root, model, opts, step: int, extra: dict | None = None, **ckpt_kwargs) -> str:
    """Save a training state with refckpt; returns the step directory."""
    extra = {"global_step": step} if extra is None else extra
    DistributedCheckpointer(**ckpt_kwargs).save(root, get_training_state(model, opts, extra), global_step=step)
    return os.path.join(os.fspath(root), f"global_step_{step}")


def save_trained(root, step: int, seed: int = 0, kind: str = "adamw", **ckpt_kwargs):
    """Train a fresh model ``step`` steps and save it as ``global_step_<step>``.

    Returns (step_dir, params snapshot, optimizer-state snapshot), snapshots taken before the save.
    """
    model, opt = make(seed, kind)
    train(model, opt, range(step))
    p, o = params(model), opt_snapshot(opt)
    return save(root, model, opt, step, **ckpt_kwargs), p, o


def save_family(root, step: int, seed: int = 0, kind: str = "adamw_amsgrad", lr: float | None = None):
    """Train, then save as the VeOmni / hyper_parallel family does, with no refckpt code: plain
    ``dcp.save`` (``.metadata`` + ``__0_0.distcp``) and ``torch.save`` of the extra state to
    ``extra_state/extra_state_rank_0.pt``. Returns (step_dir, model, opt, params, optimizer
    snapshot, extra snapshot), snapshots taken before the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make(seed, kind)
    train(model, opt, range(step))
    if lr is not None:
        opt.param_groups[0]["lr"] = lr
    msd, osd = get_state_dict(model, opt)  # FQN-keyed, as the family saves it
    step_dir = os.path.join(os.fspath(root), f"global_step_{step}")
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=step_dir, no_dist=True)
    torch.manual_seed(77)
    extra = {"global_step": step, "rng": torch.get_rng_state(), "sampler": {"epoch": 1, "index": [4, 2]}}
    os.makedirs(os.path.join(step_dir, "extra_state"))
    torch.save(extra, os.path.join(step_dir, EXTRA_REL))
    return step_dir, model, opt, params(model), opt_snapshot(opt), clone_tree(extra)


def load_fresh(step_dir, seed: int = 99, kind: str = "adamw", **ckpt_kwargs):
    """Load ``step_dir`` into a freshly built model and optimizer (different seed: different init)."""
    model, opt = make(seed, kind)
    state = get_training_state(model, opt, {})
    DistributedCheckpointer(**ckpt_kwargs).load(step_dir, state)
    extra = set_training_state(model, opt, state)
    return model, opt, extra


# -- byte-level surgery -----------------------------------------------------------------------
def safetensors_header(path: str) -> tuple[int, dict]:
    """(data section start, header dict) of a safetensors file, parsed independently of refckpt."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n, header


def item_range(path: str, key: str) -> tuple[int, int]:
    """Absolute [start, end) byte range of ``key``'s data in a safetensors file."""
    start, header = safetensors_header(path)
    a, b = header[key]["data_offsets"]
    return start + a, start + b


def flip_bit(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ (1 << bit)]))


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def read_commit_record(step_dir: str):
    return load_metadata(os.path.join(step_dir, METADATA_FILE))


def rewrite_commit_record(step_dir: str, edit: Callable[[Any], None], protocol: int | None = None) -> None:
    """Load ``.metadata`` (safely), let ``edit`` mutate it, write it back with pickle (``protocol``:
    pickle's default unless given) and a valid record checksum: a forgery by someone who knows the
    format, so only what checks the record's content (structure, the unpickler, the loaders)
    stands in the way."""
    md = read_commit_record(step_dir)
    edit(md)
    with open(os.path.join(step_dir, METADATA_FILE), "wb") as f:
        f.write(encode_record(pickle.dumps(md, protocol=protocol)))


def fix_crc(step_dir: str, rel: str, offset: int, length: int) -> None:
    """Recompute the manifest checksum (CRC-32C) of the chunk ``(offset, length)`` of ``rel`` from the bytes on disk."""
    with open(os.path.join(step_dir, rel), "rb") as f:
        f.seek(offset)
        crc = crc32c.crc32c(f.read(length))

    def edit(md):
        chunks = getattr(md, MANIFEST_ATTR)["files"][rel]["chunks"]
        for c in chunks:
            if c[0] == offset:
                assert c[1] == length
                c[2] = crc
                return
        raise AssertionError(f"no chunk at {offset} in {rel}")

    rewrite_commit_record(step_dir, edit)


def write_pointer(root, content: bytes) -> None:
    with open(os.path.join(os.fspath(root), refckpt.LATEST_CHECKPOINT_FILE), "wb") as f:
        f.write(content)


class Marker:
    """A pickle whose unpickling would create ``path`` (and run os.system): proof of code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def malicious_pickle(marker_path: str) -> bytes:
    return pickle.dumps(Marker(marker_path), protocol=2)


def replace_extra_file(step_dir: str, data: bytes, rel: str = EXTRA_REL) -> None:
    """Put ``data`` in rank 0's extra-state file with a commit record that agrees with it
    (size and CRC-32C), so only what reads the bytes stands in the way."""
    with open(os.path.join(step_dir, rel), "wb") as f:
        f.write(data)

    def edit(md):
        getattr(md, MANIFEST_ATTR)["files"][rel] = {"size": len(data), "chunks": [[0, len(data), crc32c.crc32c(data)]]}

    rewrite_commit_record(step_dir, edit)


@contextlib.contextmanager
def no_hang(seconds: int = 30):
    """Opening a FIFO for reading blocks until a writer appears: fail the test instead of hanging."""
    def expired(signum, frame):
        raise AssertionError(f"blocked for {seconds}s: a FIFO opened without O_NONBLOCK?")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_main(main, capsys, *argv) -> tuple[int, str, str]:
    """A command's ``main(argv)`` in this process: (exit code, stdout, stderr); argparse's own
    exits are caught too."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
