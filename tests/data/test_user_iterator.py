"""data.factory returning a stateful iterator: its state is checkpointed with the run and a real
SIGKILL + resume is bitwise equal to an uninterrupted run; an iterator the harness could not
checkpoint, loader workers, and a resume at another world size are refused clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.data.factory import token_sample
from harness.data.iterator_stream import IteratorStream
from harness.errors import UserError
from harness.run.trainer import Trainer
from procs import ENV, ROOT, TINY, assert_one_line_error, assert_same_run, finished, harness, kill_at_step, spawn
from shard_data import batch_hashes

sys.path.insert(0, str(Path(__file__).parent))

from user_datasets import RandomWalk  # noqa: E402

WALK = ["data.factory=tests.data.user_datasets:build_walk"]


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def test_sigkill_and_resume_of_a_user_iterator_is_bitwise(tmp_path):
    cont, intr = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(TINY), "--run-dir", str(cont), *sets(*WALK), check=True)
    args = ["train", str(TINY), "--run-dir", str(intr), *sets(*WALK)]
    assert kill_at_step(args, intr, 7) != 0, "the process finished before it could be killed"  # after the save at 4
    harness(*args, check=True)
    assert_same_run(cont, intr, 12)
    hashes = batch_hashes(cont)
    assert hashes == batch_hashes(intr) and len(set(hashes.values())) == 12  # the iterator's ids, never repeated


def test_the_iterator_state_round_trips_through_the_trainer_state():
    cfg = load_config(TINY, ["data.factory=user_datasets:build_walk"])
    trainer = Trainer(cfg)
    assert isinstance(trainer.stream, IteratorStream) and trainer.model.tok_emb.num_embeddings == 37
    for _ in range(2):
        trainer.train_step()
    state = trainer.stream.state_dict()
    assert state["samples"] == 2 * 2 * 4 and state["iterator"]["count"] == 16  # steps x accum x batch
    expected = next(trainer.stream)
    again = Trainer(cfg)
    again.stream.load_state_dict(state)
    got = next(again.stream)
    assert torch.equal(got.x, expected.x) and torch.equal(got.sample_ids, torch.arange(16, 20))
    assert got.position == 16


def test_an_iterator_without_state_dict_is_refused_at_start(tmp_path):
    proc = harness("train", str(TINY), "--run-dir", str(tmp_path / "run"),
                   *sets("data.factory=tests.data.user_datasets:build_stateless"))
    assert_one_line_error(proc, "its train source is an iterator without state_dict and load_state_dict")
    assert "add state_dict() -> dict and load_state_dict(state)" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("overrides, message", [
    (["data.factory=user_datasets:build_with_a_set"],
     "state_dict\\(\\) cannot be checkpointed: .*seen is a builtins.set"),
    (["data.factory=user_datasets:build_walk", "data.num_workers=2"],
     "data.num_workers = 2 with a data.factory iterator"),
])
def test_what_the_harness_could_not_resume_exactly_is_refused_at_start(overrides, message):
    with pytest.raises(UserError, match=message):
        Trainer(load_config(TINY, overrides))


def test_a_resume_at_another_world_size_is_refused_naming_both():
    two = IteratorStream(RandomWalk(0, 1, 16), 4, token_sample(16), rank=1, world_size=2)
    next(two)
    one = IteratorStream(RandomWalk(0, 0, 16), 4, token_sample(16))
    with pytest.raises(UserError, match="saved by rank 1 of 2, and this is rank 0 of 1: .* Resume with 2 ranks"):
        one.load_state_dict(two.state_dict())


class TwoSamples(RandomWalk):
    def __next__(self):
        if self.count == 2:
            raise StopIteration
        return super().__next__()


def test_an_ending_or_misshapen_iterator_is_a_clear_error():
    with pytest.raises(UserError, match="ended after 2 samples on rank 0: it must be endless"):
        next(IteratorStream(TwoSamples(0, 0, 16), 4, token_sample(16)))
    with pytest.raises(UserError, match="x is a tensor of shape \\(8,\\) torch.int64"):
        next(IteratorStream(RandomWalk(0, 0, 8), 4, token_sample(16)))


def test_two_ranks_train_their_iterators_and_one_rank_may_not_resume_them(tmp_path):
    # Under torchrun (gloo): each rank's iterator state in its own rank file; shrinking is refused.
    run = tmp_path / "run"
    common = ["--run-dir", str(run), *sets(*WALK, "data.batch_size=2")]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = finished(spawn([*launcher, "-m", "harness.cli", "train", str(TINY), *common, *sets("train.steps=4")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT))
    assert two.returncode == 0, two.stderr[-3000:]
    one = harness("train", str(TINY), *common, *sets("train.steps=8", "train.grad_accum=4"), "--allow-config-change")
    assert_one_line_error(one, "state was saved by rank 0 of 2, and this is rank 0 of 1")
