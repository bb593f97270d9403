"""[data]: what a run trains on: the built-in corpus, a byte-text file, prepared token shards
(`sources`, mixed by weight) or a user's dataset factory, one of them; and the batch a rank draws."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from harness.config.section import CodeSection, Section


class DataSource(Section):
    """One prepared token-shard dataset (`harness data prepare`) and its share of the mixture."""

    url: str = Field(description="Local path or fsspec URL of the dataset folder (the one holding index.json).")
    weight: float = Field(
        1.0, gt=0, description="Relative share of this source in every epoch (harness/data/mixture.py)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for this source; unset = data.storage_options."
    )


class DataSection(CodeSection):
    """The token stream: byte-level tokens from a text file at any fsspec URL, or prepared
    token shards (`sources`)."""

    url: str | None = Field(
        None,
        description=(
            "fsspec URL or path of a text file (byte tokens); unset = the built-in corpus (no download). Not together "
            "with `sources`."
        ),
    )
    sources: list[DataSource] = Field(
        default_factory=list,
        description=(
            "Token-shard datasets mixed by weight, e.g. [{url = \"data/a\", weight = 0.7}, "
            "{url = \"s3://b/c\", weight = 0.3}]; empty = the byte-text `url`. Their index hashes and weights are "
            "recorded in every checkpoint, and resuming on other data is refused."
        ),
    )
    eval_sources: list[DataSource] = Field(
        default_factory=list,
        description=(
            "Token-shard datasets to evaluate on, read whole (same tokenizer as sources); then training uses all of "
            "the sources. Empty = hold out the last eval_fraction of each source's windows, cut at a document end "
            "nearby."
        ),
    )
    factory: str | None = Field(
        None,
        description=(
            "`package.module:function` of your own dataset: called with `args` plus seq_len, seed, rank and "
            "world_size, it returns (train, eval) map-style sample sources, or a stateful iterator (state_dict / "
            "load_state_dict) to train on (contract: harness/data/factory.py). Not together with url or sources."
        ),
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments for data.factory.")
    hash_check: Literal["off", "first-open", "always"] = Field(
        "first-open",
        description=(
            "sha256 of a shard against its index: never, the first time it is opened, or every time a process opens it "
            "(sizes are always checked)."
        ),
    )
    seq_len: int = Field(
        64, gt=0, description="Tokens per sample (the model sees seq_len tokens and predicts the next of each)."
    )
    batch_size: int = Field(16, gt=0, description="Samples per micro-batch (per rank).")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes; the data order does not depend on it.")
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=1.0,
        description="Fraction of the windows held out for evaluation (> 0: every run ends with an evaluation).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for `url` (and every source without its own)."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> DataSection:
        kinds = [name for name, set_ in (("url", self.url is not None), ("sources", bool(self.sources)),
                                          ("factory", self.factory is not None)) if set_]
        if self.eval_sources and not self.sources:
            raise ValueError("eval_sources needs sources (token shards to train on)")
        if len(kinds) > 1:
            raise ValueError(f"set one of url (a text file), sources (token shards) or factory (your dataset), "
                             f"not {' and '.join(kinds)}")
        return self

