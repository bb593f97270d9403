"""The optimizer config: one pydantic class per arm, a union discriminated on `type`.

It imports no torch, so a run's config is checked (and its errors reported) before torch is
loaded, and the processes that only read a config (the supervisor) never load it. What each arm
builds from it: optim/build.py.
"""

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator


class ArmConfig(BaseModel):
    """Fields every arm has: the lr, the schedule and the head. A key an arm does not use is not
    one of its fields, so setting it is refused at config load, naming the arms that take it
    (harness/config/loading.py), never accepted and ignored."""

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
    head_lr_mult: float = Field(1.0, gt=0, description="Peak-lr multiplier for the params "
                                "matching head_pattern.")
    head_pattern: str | None = Field(None, description="fnmatch pattern of the head parameter "
                                     "names (e.g. 'head.*'); required when head_lr_mult != 1.")

    @model_validator(mode="after")
    def _head_needs_pattern(self) -> Self:
        if self.head_lr_mult != 1.0 and self.head_pattern is None:
            raise ValueError("head_lr_mult != 1 needs head_pattern (the head's parameter names)")
        return self


class WithAdamW(ArmConfig):
    """The AdamW every arm but sgdm builds (over every parameter, or the rest of the matrices)."""

    weight_decay: float = Field(1e-4, ge=0, description="AdamW's decoupled weight decay.")
    decay_1d: bool = Field(False, description="AdamW's weight decay also on parameters with fewer "
                           "than 2 dims (biases, norm gains); false = none on them (nanoGPT "
                           "practice).")
    decay_embeddings: bool = Field(False, description="AdamW's weight decay also on the weights of "
                                   "torch.nn.Embedding modules; false = none on them.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2).")


class AdamWConfig(WithAdamW):
    """AdamW on every parameter (the canonical arm)."""

    type: Literal["adamw"] = Field("adamw", description="Optimizer arm.")


class HybridConfig(WithAdamW):
    """The arms that split the parameters: a matrix optimizer on the block matrices, AdamW on the rest."""

    matrix_patterns: list[str] = Field(["blocks.*"], description="fnmatch patterns on parameter "
                                       "names; the 2D params matching one are the block matrices. "
                                       "Unset: the model's own `matrix_patterns` when it has them "
                                       "(the transformers factory: its decoder layers, e.g. "
                                       "model.layers.*), else blocks.*.")


class MuonConfig(HybridConfig):
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


class _MatrixArm(HybridConfig):
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


class SGDMConfig(ArmConfig):
    """Nesterov momentum SGD on every parameter at lr (no split, no AdamW: none of AdamW's keys,
    and no weight decay)."""

    type: Literal["sgdm"] = Field("sgdm", description="Optimizer arm.")
    momentum: float = Field(0.95, ge=0, lt=1, description="SGD momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum.")


# Each arm's config class by its `type`.
ARMS: dict[str, type[ArmConfig]] = {"adamw": AdamWConfig, "muon": MuonConfig, "lion": LionConfig,
                                  "olion": OLionConfig, "adafactor": AdafactorConfig, "sgdm": SGDMConfig}


# Keys an arm accepted and ignored before each arm's config had only the keys it uses: a saved
# config's are dropped when it is read back (their values never changed a number).
IGNORED_BEFORE: dict[str, tuple[str, ...]] = {
    "adamw": ("matrix_patterns",),
    "sgdm": ("weight_decay", "decay_1d", "decay_embeddings", "adam_betas", "matrix_patterns")}


def arms_taking(key: str) -> list[str]:
    """The arm types whose config has `key` (for an error that says where a key belongs)."""
    return [name for name, cls in ARMS.items() if key in cls.model_fields]


def _arm(value: Any) -> object:  # the tag it names (pydantic refuses one that is no arm)
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


def parse_optim_config(data: dict[str, Any]) -> OptimConfig:
    """Validate a dict (e.g. the `[optim]` TOML table) into the arm its `type` names."""
    return _ADAPTER.validate_python(data)
