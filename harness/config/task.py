"""[task]: what a run trains, when it is not the built-in language model. `factory` names the
user's task (harness/task: its models, data, optimizers, loss or step, eval, extra state) by its
import path, so reading a config imports none of its code (and no torch)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from harness.config.section import CodeSection

# The built-in language-model task's keys: with a task factory they would be ignored, so setting
# them then is refused (harness/config/effects.py) rather than dropped in silence.
LANGUAGE_MODEL_KEYS = {
    "model": ("factory", "args"),
    "data": ("url", "sources", "eval_sources", "factory", "args", "hash_check", "seq_len", "eval_fraction",
             "storage_options"),
}


class TaskSection(CodeSection):
    """Your own training task (docs/tasks.md); unset: the built-in language model of [model] and [data]."""

    factory: str | None = Field(
        None,
        description=(
            "`package.module:function` called with one dict (`args`) that returns the task: an object with "
            "models(ctx), data(ctx) and loss(models, batch) or step(models, optim, batch, info); optional "
            "optimizers, evaluate, state, after_step, collate, tokens (contract: docs/tasks.md). Unset: the "
            "built-in language model ([model], [data])."
        ),
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments for task.factory (math keys).")
