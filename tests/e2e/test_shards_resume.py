"""Training on two mixed token-shard sources: interrupted vs continuous with real SIGKILLs,
bitwise, with 0 and 2 loader workers; resuming on other data is refused; the vocabulary check."""

from __future__ import annotations

import json
import random
import re

import pytest

from harness.config import load_config
from harness.errors import UserError
from harness.run.trainer import Trainer
from procs import TINY, assert_same_run, harness, kill_at_step
from shard_data import batch_hashes, make_sources, sources_args

STEPS = 12


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("workers, kills", [(0, 2), (2, 1)])
def test_sigkill_on_mixed_shards_is_bitwise(tmp_path, sources, workers, kills):
    extra = sources_args(*sources, workers=workers)
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *extra, check=True)
    args = ["train", str(TINY), "--run-dir", str(intr), *extra]
    for step in sorted(random.Random(19 + workers).sample(range(5, STEPS), kills)):
        assert kill_at_step(args, intr, step) != 0, "the process finished before it could be killed"
    harness(*args, check=True)
    assert_same_run(cont, intr, STEPS)
    assert batch_hashes(cont) == batch_hashes(intr) and len(batch_hashes(cont)) == STEPS
    records = [json.loads(line) for line in (cont / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["data_s"] < r["optim_s"] + 60 for r in records if "loss" in r)  # recorded every step


def test_resume_on_other_data_is_refused_naming_the_difference(tmp_path, sources):
    run = tmp_path / "run"
    a, b = sources
    first = harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", *sources_args(a, b),
                    check=True)
    # The start names the sizes of the split: eval is about eval_fraction (0.05) of the windows.
    sizes = dict(re.findall(r"\b(train_windows|eval_windows|eval_share)=([\d.]+)", first.stderr))
    assert set(sizes) == {"train_windows", "eval_windows", "eval_share"}, first.stderr
    assert 0.045 <= float(sizes["eval_share"]) <= 0.055, first.stderr
    swapped = harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=8", *sources_args(b, a))
    assert swapped.returncode == 2, swapped.stderr[-2000:]
    assert "data.sources[0] index sha256" in swapped.stderr and "data.sources[1] index sha256" in swapped.stderr
    assert len(swapped.stderr.strip().splitlines()) == 1


def test_model_vocabulary_must_cover_the_tokenizer(sources):
    cfg = load_config(TINY, sources_args(*sources)[1::2] + ["model.args.vocab_size=256"])
    with pytest.raises(UserError, match="model.args.vocab_size = 256 does not cover the data's vocabulary .257 ids"):
        Trainer(cfg)
    cfg = load_config(TINY, sources_args(*sources)[1::2])
    assert Trainer(cfg).model.tok_emb.num_embeddings == 257  # unset: taken from the index
