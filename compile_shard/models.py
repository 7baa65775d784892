"""Small decoders for the demo, the tests, the examples and the benchmarks (no downloads).

``Llama``: RMSNorm, RoPE, SwiGLU, tied embedding. ``GPT``: the nanoGPT-style model of
torch's FSDP2 tutorial (LayerNorm, biased linear layers, GELU, learned position
embeddings), whose layer-norm and embedding gradients are reductions that eager CPU
bf16 kernels and Inductor round differently (docs/torch-2.13-findings.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "GPTBlock", "GPTConfig", "LlamaConfig", "Llama", "TransformerBlock", "tensor_parallel_plan"]


@dataclass
class LlamaConfig:
    vocab_size: int = 1001  # odd and not divisible by 3: dim 0 shards unevenly
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 176
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    checkpoint_blocks: bool = False  # non-reentrant torch.utils.checkpoint around each block


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Heads are counted from the projections' width, so a tensor-parallel plan that
        # shards wq, wk and wv by columns gives each rank its own heads.
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)) for proj in (self.wq, self.wk, self.wv))
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(-2))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder with RMSNorm, causal SDPA attention with RoPE, SwiGLU, tied embedding/output."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight
        cos, sin = _rope_tables(config.dim // config.n_heads, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-style init (normal, std 0.02); norms start at one."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.size(1)
        cos, sin = self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.config.checkpoint_blocks:
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))


@dataclass
class GPTConfig:
    vocab_size: int = 1024
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 64


class GPTAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(config.dim, config.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (self.n_heads, -1)).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = GPTAttention(config)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.w1 = nn.Linear(config.dim, 4 * config.dim)
        self.w2 = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))


class GPT(nn.Module):
    """Learned token and position embeddings, LayerNorm blocks with a GELU MLP, an untied output layer.

    ``reset_parameters`` re-initializes every layer with its own defaults, so a model
    built on the meta device and materialized with ``to_empty`` gets values.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """Megatron's tensor-parallel plan for a ``TransformerBlock``, for ``parallelize_module(block, tp_mesh, plan)``.

    The attention's query, key and value projections and the feed-forward's ``w1`` and
    ``w3`` are split by output columns, ``wo`` and ``w2`` by input rows, so each block
    all-reduces twice in forward; the norms stay replicated.
    """
    return {
        **{f"attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")},
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
