"""The synthetic model of the layer benchmarks: Llama-3-8B's per-layer shapes in bf16, random weights.

A layer is RMSNorm, QKV projection, attention (each benchmark brings its own:
over a prefix read from the paged cache, over a layer buffer), output
projection, RMSNorm and a gated MLP. Only the time it takes matters; its
output is never checked. ``TINY`` is the same layer at ``--quick`` sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int = 16

    @property
    def plane_bytes(self) -> int:  # K (or V) of one block of one layer
        return self.block_size * self.kv_heads * self.head_dim * DTYPE.itemsize

    @property
    def block_bytes(self) -> int:  # K and V of one block of one layer
        return 2 * self.plane_bytes


LLAMA3_8B = Model("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
TINY = Model("tiny (--quick)", layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512)


class Weights:
    def __init__(self, m: Model, device: torch.device, gen: torch.Generator) -> None:
        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) * rows ** -0.5).to(device, DTYPE)

        self.qkv = w(m.hidden, (m.heads + 2 * m.kv_heads) * m.head_dim)
        self.o = w(m.heads * m.head_dim, m.hidden)
        self.gate_up = w(m.hidden, 2 * m.intermediate)
        self.down = w(m.intermediate, m.hidden)
        self.norm = torch.ones(m.hidden, dtype=DTYPE, device=device)


def random_rows(m: Model, rows: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """The hidden states of ``rows`` tokens entering the first layer."""
    return torch.randn(rows, m.hidden, generator=gen).to(device, DTYPE)


def project(m: Model, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm and the QKV projection: q ``[tokens, heads * dim]``, k and v ``[tokens, kv_heads * dim]``."""
    hd, kvd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    qkv = F.rms_norm(x, (m.hidden,), w.norm) @ w.qkv
    return qkv[:, :hd], qkv[:, hd:hd + kvd], qkv[:, hd + kvd:]


def attend_grouped(m: Model, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The queries ``[tokens, heads * dim]`` of one sequence over ``k``, ``v`` ``[1, kv_heads, n, dim]``.

    The query heads sharing a KV head are folded into the query length, so
    flash attention runs without GQA support. Returns ``[tokens, heads * dim]``.
    """
    tokens, g = q.shape[0], m.heads // m.kv_heads
    q = q.reshape(tokens, m.kv_heads, g, m.head_dim).permute(1, 2, 0, 3).reshape(1, m.kv_heads, g * tokens, -1)
    o = F.scaled_dot_product_attention(q, k, v)
    return o.reshape(m.kv_heads, g, tokens, m.head_dim).permute(2, 0, 1, 3).reshape(tokens, -1)


def finish(m: Model, w: Weights, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of the layer after attention ``o``: output projection, RMSNorm, gated MLP (both residual)."""
    x = x + o @ w.o
    gu = F.rms_norm(x, (m.hidden,), w.norm) @ w.gate_up
    return x + (F.silu(gu[:, : m.intermediate]) * gu[:, m.intermediate:]) @ w.down
