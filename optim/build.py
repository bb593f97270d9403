"""Optimizer config (optim/config.py) -> a named optimizer bundle + schedules.

Arms: `adamw` (one AdamW over every parameter; the default when `type` is absent, and bit for
bit `torch.optim.AdamW(model.parameters(), lr, betas, weight_decay)` with the schedule below),
`muon | lion | olion | adafactor` (that rule on the "block matrices", AdamW on the rest, as in the
team's reference `build_hybrid` / `build_alt`), and `sgdm` (Nesterov SGD on everything, the
fully-local baseline; no split, no weight decay: its config has no AdamW keys, optim/config.py).

Block matrices are the 2D parameters whose `model.named_parameters()` name matches one of
`matrix_patterns` (fnmatch). A config that leaves it unset takes the model's own
`matrix_patterns` attribute when it has one (harness.models.hf: the decoder layers of a
transformers model), else `blocks.*` (the reference's `blocks.parameters()` with ndim == 2). Every
optimizer gets the same schedule (`optim.schedule`: warmup, then cosine, linear or
warmup-stable-decay); `head_lr_mult` scales
the peak lr of the parameters matching `head_pattern`, in whichever optimizer holds them.
Bundle names: the arm's name for the matrix optimizer, `adamw` for the rest (omitted when
nothing is left), `sgdm` for the SGD arm.

Weight decay in AdamW (the adamw arm and the AdamW part of every hybrid arm): by default not on
parameters with fewer than 2 dims (biases, norm gains) nor on embedding tables (the weights of
`torch.nn.Embedding` modules): nanoGPT decays only parameters with 2+ dims, minGPT also leaves
out embeddings. Decaying a norm gain or a bias towards 0 only fights the parameter's role, and
decaying rarely-seen token rows shrinks them on every step where they get no gradient.
`decay_1d` / `decay_embeddings` turn it back on (the reference decays everything). Each AdamW
group is then split in two, decayed first, so groups are [rest, rest no-decay, head, head no-decay]
(empty ones dropped).
"""

from fnmatch import fnmatchcase
from typing import Any

import torch

from optim.adafactor import Adafactor2D
from optim.bundle import MultiOpt
from optim.config import (
    AdafactorConfig,
    AdamWConfig,
    ArmConfig,
    HybridConfig,
    LionConfig,
    MuonConfig,
    OLionConfig,
    OptimConfig,
    SGDMConfig,
    WithAdamW,
)
from optim.errors import OptimError
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion
from optim.schedule import Schedule, ScheduledLR
from optim.schedulers import MultiSched, bundle

# (name, parameter) pairs, as `model.named_parameters()` yields them.
Named = list[tuple[str, torch.nn.Parameter]]


def _groups(named: Named, lr: float, cfg: ArmConfig) -> list[dict[str, Any]]:
    """One group at `lr`, or [rest, head] with the head at lr * head_lr_mult (reference order)."""
    if cfg.head_lr_mult == 1.0:
        return [{"params": named, "lr": lr}]
    assert cfg.head_pattern is not None, "ArmConfig requires head_pattern when head_lr_mult != 1"
    head = [(n, p) for n, p in named if fnmatchcase(n, cfg.head_pattern)]
    rest = [(n, p) for n, p in named if not fnmatchcase(n, cfg.head_pattern)]
    groups = [{"params": rest, "lr": lr}, {"params": head, "lr": lr * cfg.head_lr_mult}]
    return [g for g in groups if g["params"]]


def _decay_split(groups: list[dict[str, Any]], cfg: WithAdamW, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Each AdamW group split into [decayed, not decayed] (module docstring), empty ones dropped."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                  for p in m.parameters(recurse=False)}

    def exempt(p: torch.Tensor) -> bool:
        return (p.ndim < 2 and not cfg.decay_1d) or (id(p) in embeddings and not cfg.decay_embeddings)

    out = []
    for group in groups:
        out.append({**group, "params": [(n, p) for n, p in group["params"] if not exempt(p)]})
        out.append({**group, "params": [(n, p) for n, p in group["params"] if exempt(p)],
                    "weight_decay": 0.0})
    return [g for g in out if g["params"]]


def _adamw(named: Named, cfg: WithAdamW, model: torch.nn.Module) -> torch.optim.AdamW:
    """The AdamW of the adamw arm (every parameter) or of a hybrid arm (the rest)."""
    beta1, beta2 = cfg.adam_betas
    return torch.optim.AdamW(_decay_split(_groups(named, cfg.lr, cfg), cfg, model), lr=cfg.lr,
                             betas=(beta1, beta2), weight_decay=cfg.weight_decay)


def _matrix_optimizer(cfg: MuonConfig | LionConfig | OLionConfig | AdafactorConfig,
                      matrices: Named) -> torch.optim.Optimizer:
    if isinstance(cfg, MuonConfig):
        return Muon(_groups(matrices, cfg.lr_muon, cfg), lr=cfg.lr_muon, momentum=cfg.momentum,
                    ns_steps=cfg.ns_steps, nesterov=cfg.nesterov,
                    consistent_rms=cfg.consistent_rms, ns_dtype=cfg.ns_dtype,
                    weight_decay=cfg.muon_weight_decay)
    lr = cfg.lr_matrix if cfg.lr_matrix is not None else cfg.lr
    groups = _groups(matrices, lr, cfg)
    if isinstance(cfg, OLionConfig):
        return OLion(groups, lr=lr, gamma=cfg.gamma, wd=cfg.wd)
    optimizer: type[Lion] | type[Adafactor2D] = {"lion": Lion, "adafactor": Adafactor2D}[cfg.type]
    return optimizer(groups, lr=lr, wd=cfg.wd)


def matrix_patterns(cfg: HybridConfig, model: torch.nn.Module) -> list[str]:
    """The config's `matrix_patterns` when it sets them, else the model's own (a
    `matrix_patterns` attribute), else the default `blocks.*`: a setting given wins."""
    if "matrix_patterns" in cfg.model_fields_set:
        return cfg.matrix_patterns
    return list(getattr(model, "matrix_patterns", cfg.matrix_patterns))


def build_bundle(
    cfg: OptimConfig, model: torch.nn.Module, total_steps: int
) -> tuple[MultiOpt, MultiSched]:
    """The optimizers and schedules `cfg` describes over `model.named_parameters()`.

    `total_steps` is the run's length, used when `cfg.total_steps` is None.
    Raises OptimError when the split or the head pattern matches no parameter.
    """
    named = list(model.named_parameters())
    if cfg.head_lr_mult != 1.0:
        assert cfg.head_pattern is not None, "ArmConfig requires head_pattern when head_lr_mult != 1"
        if not any(fnmatchcase(n, cfg.head_pattern) for n, _ in named):
            raise OptimError(f"head_pattern {cfg.head_pattern!r} matches no parameter of the model; "
                            f"names look like {[n for n, _ in named[:5]]}")
    optimizers: dict[str, torch.optim.Optimizer]
    if isinstance(cfg, SGDMConfig):
        optimizers = {"sgdm": torch.optim.SGD(_groups(named, cfg.lr, cfg), lr=cfg.lr,
                                              momentum=cfg.momentum, nesterov=cfg.nesterov)}
    elif isinstance(cfg, AdamWConfig):
        optimizers = {"adamw": _adamw(named, cfg, model)}
    else:
        patterns = matrix_patterns(cfg, model)
        is_matrix = [p.ndim == 2 and any(fnmatchcase(n, pat) for pat in patterns) for n, p in named]
        matrices = [pair for pair, m in zip(named, is_matrix, strict=True) if m]
        rest = [pair for pair, m in zip(named, is_matrix, strict=True) if not m]
        if not matrices:
            raise OptimError(f"optim.matrix_patterns {patterns} match no 2D parameter "
                            f"for the {cfg.type} arm; names look like {[n for n, _ in named[:5]]}")
        optimizers = {cfg.type: _matrix_optimizer(cfg, matrices)}
        if rest:
            optimizers["adamw"] = _adamw(rest, cfg, model)
    schedule = Schedule(cfg.schedule, cfg.warmup,
                        cfg.total_steps if cfg.total_steps is not None else total_steps,
                        cfg.lr_min_ratio, cfg.decay_fraction)
    return bundle(optimizers, {name: ScheduledLR(opt, schedule) for name, opt in optimizers.items()})
