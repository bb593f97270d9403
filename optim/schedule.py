"""The learning-rate multiplier every arm uses: linear warmup, then cosine to `lr_min_ratio`.

The team's reference schedule, written once for all optimizers. The multiplier at scheduler
step s (0-based, as `LambdaLR` counts) is
    (s + 1) / max(warmup, 1)                                        for s < warmup
    r + (1 - r) * (1 + cos(pi * min(1, (s - warmup) / max(1, total_steps - warmup)))) / 2
                                                                    after, if total_steps > 0
    min(1, (s + 1) / max(warmup, 1))                                if total_steps == 0
so a run without a known length stays at the peak after warmup (the reference's legacy mode).
"""

import math
from collections.abc import Callable


def warmup_cosine(warmup: int, total_steps: int, lr_min_ratio: float) -> Callable[[int], float]:
    """The multiplier as a plain function of the step, for `torch.optim.lr_scheduler.LambdaLR`.

    A plain function (not a callable object) keeps the schedule out of the scheduler's state:
    it is rebuilt from the config on resume.
    """
    if total_steps <= 0:
        def constant_after_warmup(step: int) -> float:
            return min(1.0, (step + 1) / max(warmup, 1))

        return constant_after_warmup

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return lr_min_ratio + 0.5 * (1 - lr_min_ratio) * (1 + math.cos(math.pi * progress))

    return multiplier
