"""Optimizer config (a union discriminated on `type`) -> a named optimizer bundle + schedules.

Arms: `adamw` (one AdamW over every parameter; the default when `type` is absent, and bit for
bit `torch.optim.AdamW(model.parameters(), lr, betas, weight_decay)` with the schedule below),
`muon | lion | olion | adafactor` (that rule on the "block matrices", AdamW on the rest, as in the
team's reference `build_hybrid` / `build_alt`), and `sgdm` (Nesterov SGD on everything, the
fully-local baseline; no split).

Block matrices are the 2D parameters whose `model.named_parameters()` name matches one of
`matrix_patterns` (fnmatch; the default `blocks.*` is the reference's
`blocks.parameters()` with ndim == 2). Every optimizer gets the same schedule
(`optim.schedule`: warmup, then cosine, linear or warmup-stable-decay); `head_lr_mult` scales
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
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from optim.errors import OptimError
from optim.adafactor import Adafactor2D
from optim.bundle import MultiOpt, MultiSched
from optim.lion import Lion
from optim.muon import Muon
from optim.olion import OLion
from optim.schedule import Schedule, ScheduledLR


class _Shared(BaseModel):
    """Fields every arm has: the AdamW ("rest") optimizer, the schedule, the head and the split."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(3e-4, gt=0, description="Peak lr of AdamW (all params for adamw, the "
                      "non-matrix rest otherwise; sgdm's lr).")
    warmup: int = Field(0, ge=0, description="Linear warmup steps (multiplier (s+1)/warmup).")
    schedule: Literal["cosine", "linear", "wsd"] = Field("cosine", description="Decay after "
                                                         "warmup: cosine or linear to "
                                                         "lr_min_ratio, or wsd (warmup-stable-"
                                                         "decay: the peak lr, then a linear decay "
                                                         "over the last decay_fraction of the "
                                                         "steps; extending a run moves the decay).")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd only: the share of the "
                                  "post-warmup steps spent decaying.")
    total_steps: int | None = Field(None, ge=0, description="Schedule length: decay to "
                                    "lr_min_ratio over total_steps, 0 = constant after warmup, "
                                    "None = the run's length (build_bundle's total_steps). A "
                                    "change on resume re-plans the rest without an lr jump "
                                    "(optim/schedule.py).")
    lr_min_ratio: float = Field(0.1, ge=0, le=1, description="Final lr / peak lr of the decay.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW's decoupled weight decay.")
    decay_1d: bool = Field(False, description="AdamW's weight decay also on parameters with fewer "
                           "than 2 dims (biases, norm gains); false = none on them (nanoGPT "
                           "practice). Unused by sgdm.")
    decay_embeddings: bool = Field(False, description="AdamW's weight decay also on the weights of "
                                   "torch.nn.Embedding modules; false = none on them. Unused by "
                                   "sgdm.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2).")
    head_lr_mult: float = Field(1.0, gt=0, description="Peak-lr multiplier for the params "
                                "matching head_pattern.")
    head_pattern: str | None = Field(None, description="fnmatch pattern of the head parameter "
                                     "names (e.g. 'head.*'); required when head_lr_mult != 1.")
    matrix_patterns: list[str] = Field(["blocks.*"], description="fnmatch patterns on parameter "
                                       "names; the 2D params matching one are the block matrices "
                                       "(unused by adamw and sgdm).")

    @model_validator(mode="after")
    def _head_needs_pattern(self):
        if self.head_lr_mult != 1.0 and self.head_pattern is None:
            raise ValueError("head_lr_mult != 1 needs head_pattern (the head's parameter names)")
        return self


class AdamWConfig(_Shared):
    """AdamW on every parameter (the canonical arm)."""

    type: Literal["adamw"] = Field("adamw", description="Optimizer arm.")


class MuonConfig(_Shared):
    """Muon on the block matrices (optim.muon), AdamW on the rest."""

    type: Literal["muon"] = Field("muon", description="Optimizer arm.")
    lr_muon: float = Field(0.02, gt=0, description="Muon's peak lr.")
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum in Muon.")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations.")
    consistent_rms: float | None = Field(None, gt=0, description="None: scale updates by "
                                         "sqrt(max(1, rows/cols)) (reference); a float such as "
                                         "0.2: by consistent_rms*sqrt(max(rows, cols)) "
                                         "(Moonlight; AdamW lrs transfer).")
    ns_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Newton-Schulz dtype, whatever the parameter dtype (the reference runs "
        "NS in the parameter dtype). auto: bfloat16 on CUDA (tensor cores, as the field runs Muon), "
        "float32 elsewhere (on a CPU the reference math, and faster there: docs/bench-optim.md).")
    muon_weight_decay: float = Field(0.0, ge=0, description="Muon's decoupled weight decay.")


class _MatrixArm(_Shared):
    """Fields of the arms that take one lr and weight decay for the block matrices."""

    lr_matrix: float | None = Field(None, gt=0, description="Peak lr of the block-matrix "
                                    "optimizer; None = lr.")
    wd: float = Field(0.0, ge=0, description="Decoupled weight decay of the block-matrix "
                      "optimizer.")


class LionConfig(_MatrixArm):
    """Lion on the block matrices (optim.lion), AdamW on the rest."""

    type: Literal["lion"] = Field("lion", description="Optimizer arm.")


class OLionConfig(_MatrixArm):
    """OLion on the block matrices (optim.olion), AdamW on the rest."""

    type: Literal["olion"] = Field("olion", description="Optimizer arm.")
    gamma: float = Field(0.2, gt=0, description="OLion's RMS alignment (update = gamma*sign(Q)).")


class AdafactorConfig(_MatrixArm):
    """Adafactor2D on the block matrices (optim.adafactor), AdamW on the rest."""

    type: Literal["adafactor"] = Field("adafactor", description="Optimizer arm.")


class SGDMConfig(_Shared):
    """Nesterov momentum SGD on every parameter at lr (no split, no AdamW)."""

    type: Literal["sgdm"] = Field("sgdm", description="Optimizer arm.")
    momentum: float = Field(0.95, ge=0, lt=1, description="SGD momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum.")


# Each arm's config class by its `type`.
ARMS: dict[str, type[_Shared]] = {"adamw": AdamWConfig, "muon": MuonConfig, "lion": LionConfig,
                                  "olion": OLionConfig, "adafactor": AdafactorConfig, "sgdm": SGDMConfig}


def arms_taking(key: str) -> list[str]:
    """The arm types whose config has `key` (for an error that says where a key belongs)."""
    return [name for name, cls in ARMS.items() if key in cls.model_fields]


def _arm(value: Any) -> str:
    # A config without `type` is the canonical AdamW arm.
    if isinstance(value, dict):
        return value.get("type", "adamw")
    return getattr(value, "type", "adamw")


OptimConfig = Annotated[
    Annotated[AdamWConfig, Tag("adamw")]
    | Annotated[MuonConfig, Tag("muon")]
    | Annotated[LionConfig, Tag("lion")]
    | Annotated[OLionConfig, Tag("olion")]
    | Annotated[AdafactorConfig, Tag("adafactor")]
    | Annotated[SGDMConfig, Tag("sgdm")],
    Discriminator(_arm),
]

_ADAPTER = TypeAdapter(OptimConfig)


def parse_optim_config(data: dict) -> OptimConfig:
    """Validate a dict (e.g. the `[optim]` TOML table) into the arm its `type` names."""
    return _ADAPTER.validate_python(data)


def _groups(named: list, lr: float, cfg: _Shared) -> list[dict]:
    """One group at `lr`, or [rest, head] with the head at lr * head_lr_mult (reference order)."""
    if cfg.head_lr_mult == 1.0:
        return [{"params": named, "lr": lr}]
    head = [(n, p) for n, p in named if fnmatchcase(n, cfg.head_pattern)]
    rest = [(n, p) for n, p in named if not fnmatchcase(n, cfg.head_pattern)]
    groups = [{"params": rest, "lr": lr}, {"params": head, "lr": lr * cfg.head_lr_mult}]
    return [g for g in groups if g["params"]]


def _decay_split(groups: list[dict], cfg: _Shared, model: torch.nn.Module) -> list[dict]:
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


def _matrix_optimizer(cfg: _Shared, matrices: list) -> torch.optim.Optimizer:
    if isinstance(cfg, MuonConfig):
        return Muon(_groups(matrices, cfg.lr_muon, cfg), lr=cfg.lr_muon, momentum=cfg.momentum,
                    ns_steps=cfg.ns_steps, nesterov=cfg.nesterov,
                    consistent_rms=cfg.consistent_rms, ns_dtype=cfg.ns_dtype,
                    weight_decay=cfg.muon_weight_decay)
    lr = cfg.lr_matrix if cfg.lr_matrix is not None else cfg.lr
    groups = _groups(matrices, lr, cfg)
    if isinstance(cfg, OLionConfig):
        return OLion(groups, lr=lr, gamma=cfg.gamma, wd=cfg.wd)
    return {"lion": Lion, "adafactor": Adafactor2D}[cfg.type](groups, lr=lr, wd=cfg.wd)


def build_bundle(
    cfg: OptimConfig, model: torch.nn.Module, total_steps: int
) -> tuple[MultiOpt, MultiSched]:
    """The optimizers and schedules `cfg` describes over `model.named_parameters()`.

    `total_steps` is the run's length, used when `cfg.total_steps` is None.
    Raises OptimError when the split or the head pattern matches no parameter.
    """
    named = list(model.named_parameters())
    if cfg.head_lr_mult != 1.0 and not any(fnmatchcase(n, cfg.head_pattern) for n, _ in named):
        raise OptimError(f"head_pattern {cfg.head_pattern!r} matches no parameter of the model; "
                        f"names look like {[n for n, _ in named[:5]]}")
    adamw = dict(lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
    if isinstance(cfg, AdamWConfig):
        optimizers = {"adamw": torch.optim.AdamW(_decay_split(_groups(named, cfg.lr, cfg), cfg, model),
                                                 **adamw)}
    elif isinstance(cfg, SGDMConfig):
        optimizers = {"sgdm": torch.optim.SGD(_groups(named, cfg.lr, cfg), lr=cfg.lr,
                                              momentum=cfg.momentum, nesterov=cfg.nesterov)}
    else:
        is_matrix = [p.ndim == 2 and any(fnmatchcase(n, pat) for pat in cfg.matrix_patterns)
                     for n, p in named]
        matrices = [pair for pair, m in zip(named, is_matrix) if m]
        rest = [pair for pair, m in zip(named, is_matrix) if not m]
        if not matrices:
            raise OptimError(f"optim.matrix_patterns {cfg.matrix_patterns} match no 2D parameter "
                            f"for the {cfg.type} arm; names look like {[n for n, _ in named[:5]]}")
        optimizers = {cfg.type: _matrix_optimizer(cfg, matrices)}
        if rest:
            optimizers["adamw"] = torch.optim.AdamW(_decay_split(_groups(rest, cfg.lr, cfg), cfg, model),
                                                    **adamw)
    schedule = Schedule(cfg.schedule, cfg.warmup,
                        cfg.total_steps if cfg.total_steps is not None else total_steps,
                        cfg.lr_min_ratio, cfg.decay_fraction)
    schedulers = {name: ScheduledLR(opt, schedule) for name, opt in optimizers.items()}
    return MultiOpt(optimizers), MultiSched(schedulers)
