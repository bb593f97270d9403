"""Runs grouped for `harness compare`: seeds of one setting, settings of one arm, the best lr.

Contract (everything from each run's run.json config, never from its name):
- A seed group is the runs whose configs are equal but for `train.seed` and PLACE_KEYS (where
  a run's files go, how it is logged, checkpointed and watched), and whose seeds are distinct:
  a second run of one setting with a seed already in its group is a repeat, not another seed,
  and starts a group (and arm) of its own. Runs on other data, another model, device or eval
  are different rows, never a mean over "seeds".
- An arm is the seed groups equal but for their learning rates (LR_KEYS); its lr axis is the
  first of LR_KEYS that differs between them (the matrix optimizer's lr, else `optim.lr`), or,
  when none does, the first one the config sets.
- A run counts when it trained its `train.steps` and its final eval loss is finite; a seed
  group with a run that does not count (diverged, unfinished) has no mean and is never an
  arm's best. The best lr is the counted group with the lowest mean final eval loss.
- Spread of a metric over a group's runs: mean, sample standard deviation (0 for one run),
  min and max.
- An arm's name is the folder its runs share when no other arm's run is in it (a sweep's run
  dir), else its first run's name.
- Arms come in the order their first run was given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from harness.config import flatten
from harness.experiments.comparison import ArmSummary
from harness.experiments.grid import SEED_KEY

# The lr of the matrix optimizer first: a hybrid arm's `optim.lr` is its AdamW part's.
LR_KEYS = ("optim.lr_muon", "optim.lr_matrix", "optim.lr")

# The config keys (or tables) that may differ between the seeds of one group: where the files
# go and how the run is logged, checkpointed and watched, none of which changes a compared
# number. Narrower than harness.config.FREE_FIELDS, which is what a *resume* may change: a
# resume checks the data by its identity rather than by `data.sources`, and tolerates another
# eval cadence or device, but runs that differ in those are different experiments.
PLACE_KEYS = ("run_dir", "log_dir", "log", "checkpoint", "health", "data.num_workers", "data.storage_options",
              "data.hash_check", "train.log_every", "train.fingerprint_every", "train.on_divergence",
              "train.unregistered_state")


@dataclass(frozen=True)
class Spread:
    mean: float
    std: float
    min: float
    max: float
    n: int

    @staticmethod
    def of(values: list[float]) -> Spread | None:
        if not values:
            return None
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return Spread(statistics.fmean(values), std, min(values), max(values), len(values))


@dataclass
class SeedGroup:
    """Runs of one setting that differ only by seed."""

    runs: list[ArmSummary]
    lr: float | None

    @property
    def counted(self) -> bool:
        """Every run trained its steps to a finite final eval loss."""
        return all(counts(r) for r in self.runs)

    def spread(self, metric: Callable[[ArmSummary], float | None]) -> Spread | None:
        """The metric over the group's runs; None unless every run counts and has it."""
        values = [metric(r) for r in self.runs]
        present = [v for v in values if v is not None]
        if not self.counted or len(present) != len(values):
            return None
        return Spread.of(present)

    @property
    def seeds(self) -> list[int]:
        return sorted(seed_of(r) for r in self.runs)


@dataclass
class Arm:
    name: str
    optimizer: str
    lr_key: str | None
    groups: list[SeedGroup]  # by lr, ascending

    @property
    def best(self) -> SeedGroup | None:
        """The counted group with the lowest mean final eval loss."""
        scored = [(s.mean, i) for i, g in enumerate(self.groups) if (s := g.spread(final_eval))]
        return self.groups[min(scored)[1]] if scored else None

    @property
    def best_at_edge(self) -> bool:
        """The best lr is the grid's smallest or largest: the optimum may lie outside it."""
        best = self.best
        return len(self.groups) > 1 and best is not None and best in (self.groups[0], self.groups[-1])


def final_eval(r: ArmSummary) -> float | None:
    return r.final_eval


def steps_to(target: float) -> Callable[[ArmSummary], float | None]:
    """The metric "steps until the eval loss first reaches `target`": the step where the line
    between the last eval above it and the first at or below it crosses it (evals are every
    train.eval_every steps); None when the run never reaches it. Tokens to a loss are this times
    the tokens of a step, the same for every arm of one base config."""

    def metric(r: ArmSummary) -> float | None:
        previous = None
        for step, _, loss in r.evals:
            if loss <= target:
                if previous is None or previous[1] == loss:
                    return float(step)
                (s0, l0) = previous
                return s0 + (step - s0) * (l0 - target) / (l0 - loss)
            previous = (step, loss)
        return None

    return metric


def seed_of(r: ArmSummary) -> int:
    return r.config.get("train", {}).get("seed", 0)


def counts(r: ArmSummary) -> bool:
    steps = r.config.get("train", {}).get("steps")
    return (r.final_eval is not None and math.isfinite(r.final_eval)
            and (steps is None or r.steps >= steps))


def _setting(config: dict, leave_out: tuple[str, ...]) -> tuple:
    flat = flatten(config)
    return tuple(sorted((k, repr(v)) for k, v in flat.items()
                        if k not in leave_out and not any(k == p or k.startswith(p + ".") for p in PLACE_KEYS)))


def group_runs(runs: list[ArmSummary]) -> list[Arm]:
    """Arms in the order their first run was given, each with its seed groups by lr."""
    made: list[dict[tuple, list[ArmSummary]]] = []  # per arm: seed group setting -> its runs
    # An arm setting's arms: the first holds the first run of each (setting, seed), the next the
    # repeats, and so on.
    by_arm: dict[tuple, list[dict[tuple, list[ArmSummary]]]] = {}
    for r in runs:
        repeats = by_arm.setdefault(_setting(r.config, (SEED_KEY, *LR_KEYS)), [])
        setting = _setting(r.config, (SEED_KEY,))
        groups = next((g for g in repeats if seed_of(r) not in map(seed_of, g.get(setting, []))), None)
        if groups is None:
            groups = {}
            repeats.append(groups)
            made.append(groups)
        groups.setdefault(setting, []).append(r)
    folders = [{_folder(r) for runs in groups.values() for r in runs} for groups in made]
    shared = {f for f in set().union(*folders) if sum(f in of_arm for of_arm in folders) > 1}
    arms = [_arm(list(groups.values()), shared) for groups in made]
    seen: dict[str, int] = {}
    for a in arms:  # two arms from folders of one name stay apart
        seen[a.name] = seen.get(a.name, 0) + 1
        if seen[a.name] > 1:
            a.name = f"{a.name} ({seen[a.name]})"
    return arms


def _folder(r: ArmSummary) -> str:
    return str(PurePosixPath(r.run_dir.rstrip("/")).parent)


def _arm(groups: list[list[ArmSummary]], shared: set[str]) -> Arm:
    """The arm of these seed groups; `shared`: folders that hold runs of other arms too, so
    their name does not name this one."""
    flats = [flatten(g[0].config) for g in groups]
    varying = [k for k in LR_KEYS if len({repr(f.get(k)) for f in flats}) > 1]
    lr_key = varying[0] if varying else next((k for k in LR_KEYS if flats[0].get(k) is not None), None)
    seed_groups = sorted((SeedGroup(g, None if lr_key is None else flat.get(lr_key))
                          for g, flat in zip(groups, flats, strict=True)),
                         key=lambda g: (g.lr is None, g.lr or 0.0))
    every = [r for g in groups for r in g]
    folders = {_folder(r) for r in every}
    own = len(every) > 1 and len(folders) == 1 and not folders & shared
    name = PurePosixPath(folders.pop()).name if own else every[0].name
    return Arm(name, every[0].optimizer, lr_key, seed_groups)
