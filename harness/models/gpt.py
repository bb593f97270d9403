"""A small GPT (decoder-only transformer) for the quickstart and the tests.

Token + learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention,
4x GELU MLP), a final LayerNorm and an untied output head (so optimizers that treat the head
specially, like Muon's `head_lr_mult`, see it as its own parameter). Linear layers have no bias;
LayerNorms have one. Dropout on embeddings, attention weights and residual branches.

Determinism: weights are drawn from the global torch RNG (normal, std 0.02), so a seed fixes the
model; dropout also draws from the global torch RNG (or the device's), so a restored RNG state
replays the same masks. Attention uses `F.scaled_dot_product_attention`, which on CPU under
`torch.use_deterministic_algorithms(True)` gives bitwise-repeatable outputs and gradients with
dropout too (tested).

Parameter names (checkpoints and optimizer bundles key on them): `tok_emb.weight`,
`pos_emb.weight`, `blocks.{i}.ln1.{weight,bias}`, `blocks.{i}.attn.qkv.weight`,
`blocks.{i}.attn.proj.weight`, `blocks.{i}.ln2.{weight,bias}`, `blocks.{i}.mlp.fc.weight`,
`blocks.{i}.mlp.proj.weight`, `ln_f.{weight,bias}`, `head.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from harness.errors import UserError


class GPTConfig(BaseModel):
    """The GPT's shape; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(256, gt=0, description="Number of token ids (256 for byte-level text).")
    seq_len: int = Field(64, gt=0, description="Longest input, in tokens: the size of the position table.")
    n_layer: int = Field(2, gt=0, description="Number of transformer blocks.")
    n_head: int = Field(2, gt=0, description="Attention heads per block; must divide d_model.")
    d_model: int = Field(64, gt=0, description="Width of the residual stream.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on embeddings, attention and residuals.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model})")
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA does not know about train/eval mode, so attention dropout is switched here.
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, time, width)
        return self.resid_drop(self.proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """`forward(x, y=None) -> (logits, loss)`: logits [B, T, vocab]; mean cross entropy against
    `y` when given, else None. Raises ValueError for inputs longer than `seq_len`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        time = x.shape[1]
        if time > self.cfg.seq_len:
            raise ValueError(f"input has {time} tokens, more than seq_len={self.cfg.seq_len}")
        positions = torch.arange(time, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation; LayerNorms keep PyTorch's ones/zeros.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_gpt(cfg: dict | GPTConfig) -> GPT:
    """The default model factory. Raises UserError naming each invalid or unknown key."""
    if isinstance(cfg, dict):
        try:
            cfg = GPTConfig.model_validate(cfg)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'model'}: {err['msg']}" for err in e.errors())
            known = ", ".join(GPTConfig.model_fields)
            raise UserError(f"invalid GPT model args: {problems} (known: {known})") from e
    return GPT(cfg)
