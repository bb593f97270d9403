"""A user model for the harness, written to the factory contract of docs/models.md.

A small byte-level language model: token and position embeddings, `n_layer` residual MLP blocks
that each mix in the running mean of the tokens so far (causal: position t sees tokens <= t),
and an output head that shares its weight with the token embedding (tied weights: the
checkpoint stores that tensor once and restores the tie).

Run it from the repository root:

    harness train examples/tied_lm.toml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LayerNorm MLP on [the state, the causal mean of the state]."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc = nn.Linear(2 * d_model, 4 * d_model, bias=False)   # 2-D, name blocks.{i}.fc.weight:
        self.proj = nn.Linear(4 * d_model, d_model, bias=False)     # the matrix optimizer's (Muon...)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.ln(h)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        past = x.cumsum(dim=1) / steps  # mean over positions <= t: no look-ahead
        return h + self.proj(F.gelu(self.fc(torch.cat([x, past], dim=-1))))


class TiedLM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layer: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)  # sized by seq_len: the longest input
        self.blocks = nn.ModuleList(Block(d_model) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one parameter, named tok_emb.weight
        nn.init.normal_(self.tok_emb.weight, std=0.02)  # from the global torch RNG: the seed fixes it

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, y: int64 token ids [batch, time], y = x shifted by one. Returns (logits [batch, time,
        vocab], the mean cross entropy as a 0-d tensor, or None without y)."""
        if x.shape[1] > self.seq_len:
            raise ValueError(f"input has {x.shape[1]} tokens, more than seq_len={self.seq_len}")
        h = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        loss = None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return logits, loss


def build(args: dict) -> TiedLM:
    """The factory: called once with `model.args` plus `seq_len` (= data.seq_len unless
    model.args sets it). Unknown keys are an error, so a typo in the config is not ignored."""
    args = dict(args)
    known = {"vocab_size": 256, "seq_len": None, "d_model": 64, "n_layer": 2}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"unknown model args {unknown}; known: {sorted(known)}")
    kwargs = {**known, **args}
    if kwargs["d_model"] <= 0 or kwargs["n_layer"] <= 0:
        raise ValueError(f"d_model and n_layer must be > 0, got {kwargs['d_model']} and {kwargs['n_layer']}")
    return TiedLM(**kwargs)
