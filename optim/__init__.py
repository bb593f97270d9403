"""Optimizers the team researches (Muon, Lion, OLion, Adafactor2D) and resumable bundles.

`optim.build.build_bundle(cfg, model, total_steps)` turns an `OptimConfig` into a `MultiOpt`
(name-keyed, resumable optimizers) and a `MultiSched` (their schedules: warmup, then cosine,
linear or warmup-stable-decay; `optim.schedule`).
"""

from optim.adafactor import Adafactor2D
from optim.build import OptimConfig, build_bundle, parse_optim_config
from optim.bundle import MultiOpt, MultiSched
from optim.lion import Lion
from optim.muon import Muon
from optim.newton_schulz import newton_schulz
from optim.olion import OLion

__all__ = ["Adafactor2D", "Lion", "Muon", "MultiOpt", "MultiSched", "OLion", "OptimConfig",
           "build_bundle", "newton_schulz", "parse_optim_config"]
