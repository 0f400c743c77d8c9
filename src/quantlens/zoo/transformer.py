"""A tiny pre-norm transformer encoder classifier with hand-written attention.

Attention is written with plain ``torch.matmul`` / ``torch.softmax`` (not ``nn.MultiheadAttention`` or
``scaled_dot_product_attention``) so that every op -- the q@k^T matmul, the scale, the softmax and the
attention@v matmul -- is a separate, interceptable op site with its own quantization.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quantlens.sites.stubs import DeQuantStub

__all__ = ["MultiHeadSelfAttention", "TinyTransformerEncoder"]


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention from Linear q/k/v projections, two matmuls and a softmax. No masking."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, dim = x.shape
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale  # [B, H, T, T]
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn, v)  # [B, H, T, d]
        ctx = ctx.transpose(1, 2).reshape(b, t, dim)
        return self.out_proj(ctx)


class TinyTransformerEncoder(nn.Module):
    """One pre-norm encoder layer over token ids, mean-pooled into a classifier.

    Input ``[B, T]`` int64 token ids in ``[0, vocab_size)`` with ``T <= seq_len``; output
    ``[B, num_classes]`` logits. Integer ids need no QuantStub: the embedding lookup produces the first
    quantized tensor from the (quantized) embedding tables.

    ``x = tok_emb(ids) + pos_emb(arange(T))``; ``x = x + attn(norm1(x))``;
    ``x = x + fc2(gelu(fc1(norm2(x))))``; ``logits = classifier(mean_T(x))``.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        dim: int = 32,
        heads: int = 4,
        ff: int = 64,
        seq_len: int = 16,
        num_classes: int = 4,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ff, dim)
        self.classifier = nn.Linear(dim, num_classes)
        self.dequant = DeQuantStub()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the positional table size seq_len={self.seq_len}")
        positions = torch.arange(t, device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)  # [B, T, D] + [T, D] broadcasts over the batch
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(self.act(self.fc1(self.norm2(x))))
        x = x.mean(dim=1)
        x = self.classifier(x)
        return self.dequant(x)
