"""[model]: the factory a run builds its model with and its arguments. Naming the factory by its
import path keeps reading a config free of model code (and of torch)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from harness.config.section import CodeSection

# The built-in GPT (harness/models/gpt.py), named by its path so that reading a config imports no
# model code (and no torch).
DEFAULT_FACTORY = "harness.models.gpt:build_gpt"


class ModelSection(CodeSection):
    """The model: a factory import path and the keyword arguments it is called with."""

    factory: str = Field(
        DEFAULT_FACTORY,
        description=(
            "`package.module:function` called with one dict (`args`, plus `seq_len` from data.seq_len unless `args` "
            "sets it) that returns the nn.Module; its forward(x, y) returns (logits, loss). The full contract: "
            "docs/models.md."
        ),
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Arguments for the factory (for the built-in GPT: n_layer, n_head, d_model, dropout, vocab_size; seq_len "
            "follows data.seq_len, set it here only to make the model longer than the samples)."
        ),
    )
    init_from: str | None = Field(
        None,
        description=(
            "Start from these weights: a safetensors file, or a folder holding model.safetensors (or "
            "model.safetensors.index.json and its shards), e.g. a Hugging Face model folder or `harness ckpt "
            "export`'s; every tensor of the model's state dict is loaded by name (converted to its dtype) at step 0 "
            "only, and the files' sha256 digests go into run.json. A resume never reads them again; resuming with "
            "another value is a config change."
        ),
    )

