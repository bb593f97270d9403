"""The built-in task: a language model of `[model]` (`model.factory`, docs/models.md) trained on the
token windows of `[data]` (byte text, token shards, or a data.factory), with the `[optim]`
config's bundle. Written to the task contract (contract.py) like any user's task: the trainer
knows no other."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.config import RunConfig, model_args
from harness.data.sources import TrainData, open_data
from harness.errors import UserError
from harness.models.contract import build_model, split_output
from harness.task.contract import TaskContext

NAME = "harness.task.language_model"


class LanguageModel:
    """`forward(x, y) -> (logits, loss)` on int64 token windows `(x, y)`."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.vocab_size: int | None = None  # what the data declares, read by models()

    def data(self, ctx: TaskContext) -> TrainData:
        data = open_data(self.cfg.data, ctx.seed, ctx.rank, ctx.world_size)
        self.vocab_size = data.vocab_size
        return data

    def models(self, ctx: TaskContext) -> nn.Module:
        """The model of `model.factory`, its initial weights drawn from the generators as seeded
        now. A vocabulary the data declares fills in an unset `model.args.vocab_size` and must fit
        in a set one."""
        factory_args = model_args(self.cfg)
        vocab = self.vocab_size
        if vocab is not None:  # token shards (their tokenizer), or a user dataset that says
            factory_args.setdefault("vocab_size", vocab)
            if factory_args["vocab_size"] < vocab:
                raise UserError(
                    f"model.args.vocab_size = {factory_args['vocab_size']} does not cover the data's vocabulary "
                    f"({vocab} ids): raise it to at least {vocab}, or leave it unset")
        return build_model(self.cfg.model.factory, factory_args, self.cfg.model.code_folder)

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return split_output(model(x, y))[1]

    def tokens(self, batch: Any) -> int:
        return batch[0].numel()
