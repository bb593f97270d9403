"""Users' own model factories for real `harness train` processes: `--set model.factory=
"tests.user_models:NAME"` (the processes run in the repository root, where `tests` imports).

Each wraps the built-in GPT and adds one thing real models do. Extra factory arguments come
from `model.args` and are taken out before the GPT sees the rest.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from harness.models import build_gpt


class NanGradGPT(nn.Module):
    """The GPT whose gradients turn NaN at one training forward while the loss stays finite (as
    a huge learning rate does): `0 * sqrt(w - w)` is 0 forward, but its gradient is 0 * inf."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        args = dict(args)
        self.nan_at_forward = int(args.pop("nan_grad_at_forward"))
        self.gpt = build_gpt(args)
        self.forwards = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        if self.training:
            self.forwards += 1
            if self.forwards == self.nan_at_forward:
                w = self.gpt.tok_emb.weight
                loss = loss + 0.0 * torch.sqrt((w - w.detach()).sum())
        return logits, loss


class OverflowingStatGPT(nn.Module):
    """The GPT keeping a running mean of its squared logits in a (persistent) buffer, as norm
    layers keep running statistics; at one training forward the statistic becomes inf while
    the loss and the gradients stay finite; on every rank, or only on `overflow_rank`."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        args = dict(args)
        self.overflow_at_forward = int(args.pop("overflow_at_forward"))
        rank = args.pop("overflow_rank", None)
        if rank is not None and int(os.environ.get("RANK", 0)) != rank:
            self.overflow_at_forward = -1
        self.gpt = build_gpt(args)
        self.register_buffer("logit_sq", torch.zeros(()))
        self.forwards = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        if self.training:
            self.forwards += 1
            stat = logits.detach().pow(2).mean()
            if self.forwards == self.overflow_at_forward:
                stat = torch.full_like(stat, float("inf"))
            self.logit_sq.lerp_(stat, 0.1)
        return logits, loss


class CachedMaskGPT(nn.Module):
    """The GPT plus a learned causal bias whose mask is cached in a non-persistent buffer, which
    forward rebuilds before reading it (as attention masks and rotary tables are cached)."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        self.gpt = build_gpt(args)
        seq_len = int(args["seq_len"])
        self.bias = nn.Parameter(torch.zeros(seq_len, seq_len))
        self.register_buffer("mask", torch.zeros(seq_len, seq_len), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        self.mask.copy_(torch.tril(torch.ones_like(self.mask)))
        if loss is not None:
            loss = loss + 1e-3 * (self.mask * self.bias).pow(2).mean()
        return logits, loss


class LossEmaGPT(nn.Module):
    """The GPT that keeps an EMA of its loss in a non-persistent buffer, read before it is
    written on every training forward: state that no checkpoint holds."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        self.gpt = build_gpt(args)
        self.register_buffer("loss_ema", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        if loss is not None and self.training:
            self.loss_ema.lerp_(loss.detach(), 0.1)
            loss = loss + 0.01 * self.loss_ema
        return logits, loss


class BatchNormGPT(nn.Module):
    """The GPT whose logits pass through a BatchNorm1d over the vocabulary: its running mean,
    variance and batch count are persistent buffers every training forward updates, which
    evaluation reads."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        self.gpt = build_gpt(args)
        self.norm = nn.BatchNorm1d(self.gpt.cfg.vocab_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, _ = self.gpt(x)
        logits = self.norm(logits.transpose(1, 2)).transpose(1, 2)
        loss = None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return logits, loss


def nan_grad_gpt(args: dict) -> NanGradGPT:
    return NanGradGPT(args)


def overflowing_stat_gpt(args: dict) -> OverflowingStatGPT:
    return OverflowingStatGPT(args)


def cached_mask_gpt(args: dict) -> CachedMaskGPT:
    return CachedMaskGPT(args)


def loss_ema_gpt(args: dict) -> LossEmaGPT:
    return LossEmaGPT(args)


def batch_norm_gpt(args: dict) -> BatchNormGPT:
    return BatchNormGPT(args)


class CountingEmaGPT(nn.Module):
    """The GPT keeping, as persistent buffers a forward replaces rather than updates in place,
    an EMA of its mean logit and a count of its training forwards."""

    def __init__(self, args: dict) -> None:
        super().__init__()
        self.gpt = build_gpt(args)
        self.register_buffer("logit_ema", torch.zeros(()))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        logits, loss = self.gpt(x, y)
        if self.training:
            self.logit_ema = 0.9 * self.logit_ema + 0.1 * logits.detach().mean()
            self.forwards = self.forwards + 1
        return logits, loss


def counting_ema_gpt(args: dict) -> CountingEmaGPT:
    return CountingEmaGPT(args)
