"""data.factory: a user's map-style dataset trains in the harness's global order, resumes by
cursor, records its identity; stateful sources and bad factories are refused clearly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.errors import UserError
from harness.repro.completeness import IncompleteState
from harness.run.trainer import Trainer
from procs import TINY

sys.path.insert(0, str(Path(__file__).parent))

FACTORY = ["data.factory=user_datasets:build", "data.args={train = 64}"]


def test_a_user_dataset_trains_and_resumes_by_cursor():
    cfg = load_config(TINY, FACTORY)
    trainer = Trainer(cfg)
    assert trainer.model.tok_emb.num_embeddings == 37  # its vocab_size, given to the model
    assert trainer.data.identity == {"factory": {"name": "arithmetic", "vocab": 37}}
    for _ in range(3):
        trainer.train_step()
    cursor = trainer.stream.state_dict()
    expected = next(trainer.stream)
    again = Trainer(cfg)
    again.stream.load_state_dict(cursor)
    got = next(again.stream)
    assert torch.equal(got.sample_ids, expected.sample_ids) and torch.equal(got.x, expected.x)
    assert cursor["position"] == 3 * 2 * 4  # steps x grad_accum x batch: global samples consumed
    assert trainer.evaluate()["eval_loss"] > 0


def test_a_stateful_user_dataset_is_refused_at_start():
    with pytest.raises(IncompleteState, match="generator"):
        Trainer(load_config(TINY, ["data.factory=user_datasets:build_noisy"]))


@pytest.mark.parametrize("factory, message", [
    ("user_datasets:build_one", "must return \\(train, eval\\) sample sources"),
    ("user_datasets:nothing", "data factory 'user_datasets:nothing': 'user_datasets' has no attribute"),
    ("no_such_module:build", "data factory 'no_such_module:build': cannot import module"),
])
def test_bad_factories_are_clear_errors(factory, message):
    with pytest.raises(UserError, match=message):
        Trainer(load_config(TINY, [f"data.factory={factory}"]))
