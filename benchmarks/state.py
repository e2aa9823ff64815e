"""The states the benchmark saves and loads: two mixes of tensors, each a model + AdamW state.

``size_bytes`` is always the *total* of fp32 parameters + AdamW ``exp_avg`` + ``exp_avg_sq``
(parameters are about a third of it). The mixes differ in how those bytes are cut into tensors:

* ``few-large``: four large weight matrices (no biases, no norms): 12 large tensors + 4 step
  counters -- the best case for every writer (few items, long sequential writes);
* ``transformer``: 24 blocks of LayerNorms, attention and MLP ``Linear`` layers with biases,
  an embedding, an untied LM head and a final LayerNorm -- LLM-shaped: 1,168 tensors with the
  optimizer's (issue 30 asked for 1,000+), half the bytes in the embedding, the head and their
  two moments (6 tensors), the other half in the blocks' hundreds of tensors (per-item costs
  show here).

At world size > 1 the model is sharded with FSDP2 (``fully_shard``), so every rank holds and
writes 1/N of every tensor. Both models have a forward pass (:func:`batch` and :func:`loss`), so
the benchmark's training loop trains the very state it saves. Below 96 MiB the transformer mix
has fewer blocks (one per 4 MiB, at least 2): the test suite's tiny runs keep its shape (many small
tensors, most bytes in 6) without paying for hundreds of tensors per save.
"""

from __future__ import annotations

import math
from typing import Any

MIXES: dict[str, str] = {
    "few-large": "4 large weight matrices + AdamW moments: 12 large tensors (+ 4 step counters)",
    "transformer": "24 transformer blocks, embedding, untied LM head: 1,168 tensors, half of the bytes in 6 of them",
}

#: transformer mix: number of blocks, and the share of parameters in the embedding + LM head.
_LAYERS = 24
_EMB_SHARE = 0.5
#: few-large mix: number of weight matrices.
_BIG = 4


def model_dims(size_bytes: int, mix: str = "transformer") -> dict[str, Any]:
    """Dimensions of the ``mix`` model whose params + 2 AdamW moments (fp32) total ~``size_bytes``."""
    params = max(size_bytes // 12, 1)  # 4 bytes x 3 copies
    if mix == "few-large":
        d = max(8, int(math.sqrt(params / _BIG)) // 8 * 8)
        out = max(8, round(params / (_BIG * d)))
        return {"mix": mix, "d": d, "out": out, "matrices": _BIG, "params": _BIG * d * out}
    if mix != "transformer":
        raise ValueError(f"unknown mix {mix!r}: expected one of {', '.join(MIXES)}")
    layers = layers_for(size_bytes)
    # blocks: 12 d^2 + 13 d each (qkv d->3d, proj d->d, MLP d->4d->d with biases, two LayerNorms)
    d = max(8, int(math.sqrt(params * (1 - _EMB_SHARE) / (12 * layers))) // 8 * 8)
    block = 12 * d * d + 13 * d
    vocab = max(8, (params - layers * block - 2 * d) // (2 * d))
    return {"mix": mix, "d": d, "layers": layers, "vocab": vocab, "params": layers * block + 2 * d + 2 * vocab * d}


def layers_for(size_bytes: int) -> int:
    """Transformer blocks of the mix: 24, or one per 4 MiB (at least 2) below 96 MiB."""
    return max(2, min(_LAYERS, size_bytes // (4 << 20)))


def make_model(dims: dict[str, Any]):
    import torch.nn as nn
    import torch.nn.functional as F

    d = dims["d"]
    if dims["mix"] == "few-large":
        return nn.Sequential(*(nn.Linear(d, dims["out"], bias=False) if i % 2 == 0 else nn.Linear(dims["out"], d, bias=False)
                               for i in range(dims["matrices"])))
    vocab = dims["vocab"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, h):
            q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
            h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return h + self.down(F.gelu(self.up(self.ln2(h))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(dims["layers"]))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):
            h = self.emb(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.ln_f(h))

    return LM()


#: the training loop's batch: rows of the few-large input, tokens of the transformer's sequence
TRAIN_ROWS = 4
TRAIN_TOKENS = 16


def batch(dims: dict[str, Any], seed: int = 0):
    """One fixed batch for the mix's model (the same on every rank: the loop measures time, not learning)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if dims["mix"] == "few-large":
        return torch.randn(TRAIN_ROWS, dims["d"], generator=gen)
    return torch.randint(0, dims["vocab"], (1, TRAIN_TOKENS), generator=gen)


def loss(model, dims: dict[str, Any], x):
    import torch.nn.functional as F

    if dims["mix"] == "few-large":
        return model(x).pow(2).mean()
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def make_optimizer(model):
    """AdamW, fused where this torch has a fused CPU AdamW (one pass over the state per step)."""
    import torch

    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError, ValueError):  # pragma: no cover - older torch
        return torch.optim.AdamW(model.parameters(), lr=1e-4)


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: the local shard itself


def tensors(obj, prefix: str = ""):
    """(name, local plain tensor) of every tensor in a state tree."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, local(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}")


def tensor_only(obj):
    """The state without its non-tensor leaves (for writers that store tensors only)."""
    import torch

    if isinstance(obj, dict):
        out = {k: tensor_only(v) for k, v in obj.items()}
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) or (isinstance(v, dict) and v)}
    return obj if isinstance(obj, torch.Tensor) else None


def profile(sizes: list[int]) -> dict[str, Any]:
    """How a state's bytes are cut: tensor count, largest tensor, share of the bytes in the 6 largest."""
    total = sum(sizes) or 1
    top = sorted(sizes, reverse=True)
    return {"tensors": len(sizes), "payload_bytes": sum(sizes), "largest_tensor_bytes": top[0] if top else 0,
            "top6_share": sum(top[:6]) / total}


def build_state(size_bytes: int, mix: str):
    """The benchmark state on this rank: model (FSDP2-sharded when world > 1) + AdamW, filled with values."""
    import torch
    import torch.distributed as dist

    from refckpt import get_training_state

    ws = dist.get_world_size() if dist.is_initialized() else 1
    dims = model_dims(size_bytes, mix)
    with torch.device("meta"):
        model = make_model(dims)
    if ws > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        for block in getattr(model, "blocks", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # only this rank's shards are allocated
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if dist.is_initialized() else 0))
    with torch.no_grad():
        for p in model.parameters():
            local(p).uniform_(-0.02, 0.02, generator=gen)
    opt = make_optimizer(model)
    state = get_training_state(model, opt)
    with torch.no_grad():  # zeros_like moments are untouched (not even resident) pages: give them values
        for _name, t in tensors(state["optimizer"]):
            if t.dim() and t.is_floating_point():
                t.uniform_(0.0, 1e-3, generator=gen)
    return model, opt, state, dims
