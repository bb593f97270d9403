"""Optimizers the team researches (Muon, Lion, OLion, Adafactor2D) and resumable bundles.

`optim.build.build_bundle(cfg, model, total_steps)` turns an `OptimConfig` (optim/config.py) into
a `MultiOpt` (name-keyed, resumable optimizers) and a `MultiSched` (their schedules: warmup,
then cosine, linear or warmup-stable-decay; `optim.schedule`); `optim.schedulers.bundle` pairs
any named optimizers with the (torch or our) schedulers named after them the same way.

The names below load their module on first use: `optim.config` and `optim.errors` import no
torch, and a process that only checks a config (`harness train` refusing a mistake in it) should
not pay for it.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"Adafactor2D": "adafactor", "Lion": "lion", "Muon": "muon", "MultiOpt": "bundle",
            "MultiSched": "schedulers", "OLion": "olion", "OptimConfig": "config", "build_bundle": "build",
            "bundle": "schedulers", "newton_schulz": "newton_schulz", "parse_optim_config": "config"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # one of the names above: a class or a function
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
