"""The data pipeline's guarantees: a pure-function order, O(1) seek, worker- and
world-size-independence, and no draws from the process's global RNGs."""

from __future__ import annotations

import hashlib
import json
import os
import random

import fsspec
import numpy as np
import pytest
import torch

from harness.data import VOCAB_SIZE, Batch, BatchStream, TokenDataset, eval_batches
from harness.data.corpus import default_corpus
from harness.errors import UserError

SEQ_LEN = 4


def make_dataset(num_samples: int) -> TokenDataset:
    """`num_samples` windows over a known byte pattern."""
    return TokenDataset.from_bytes(bytes(i % 251 for i in range(num_samples * SEQ_LEN + 1)), SEQ_LEN)


class CountingDataset:
    """Counts sample reads, to prove a seek reads nothing it skips."""

    def __init__(self, inner: TokenDataset):
        self.inner = inner
        self.num_samples = inner.num_samples
        self.reads = 0

    def __getitem__(self, index: int):
        self.reads += 1
        return self.inner[index]

    def sample_id(self, index: int) -> int:
        return self.inner.sample_id(index)


def take(stream: BatchStream, count: int) -> list[Batch]:
    return [next(stream) for _ in range(count)]


def assert_same_batches(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        assert (left.epoch, left.position) == (right.epoch, right.position)
        assert torch.equal(left.sample_ids, right.sample_ids)
        assert torch.equal(left.x, right.x) and torch.equal(left.y, right.y)


# --- datasets -------------------------------------------------------------------------------


def test_default_corpus_is_pinned_text():
    corpus = default_corpus()
    # The corpus must be byte-identical on every machine and Python version; a change here
    # changes every quickstart run's data, so it must be deliberate.
    assert hashlib.sha256(corpus).hexdigest() == "1624c5ae0ef63d2f45a044f66a530d39b26bf0ae9cd97a946e89e33b5e61cffb"
    assert len(corpus) == 256 * 1024
    assert corpus.decode("ascii").count(".") > 5000


def test_windows_are_shifted_byte_tokens():
    dataset = TokenDataset.from_url(None, seq_len=64)
    x, y = dataset[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (64,)
    window = torch.tensor(list(default_corpus()[3 * 64 : 4 * 64 + 1]))
    assert torch.equal(x, window[:-1]) and torch.equal(y, window[1:])
    assert int(x.max()) < VOCAB_SIZE
    assert dataset.num_samples == (256 * 1024 - 1) // 64


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_from_url_reads_fsspec_urls(tmp_path, scheme):
    data = b"hello world, hello tokens"
    url = str(tmp_path / "text.txt") if scheme == "local" else "memory://data/text.txt"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    dataset = TokenDataset.from_url(url, seq_len=SEQ_LEN)
    assert dataset.num_samples == (len(data) - 1) // SEQ_LEN
    x, y = dataset[1]
    assert bytes(x.tolist()) == data[4:8] and bytes(y.tolist()) == data[5:9]


def test_missing_file_names_the_url(tmp_path):
    url = str(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="nope.txt.*not found.*built-in corpus"):
        TokenDataset.from_url(url, seq_len=SEQ_LEN)


def test_too_short_text_is_a_user_error():
    with pytest.raises(UserError, match="too short"):
        TokenDataset.from_bytes(b"abc", seq_len=8)


def test_split_holds_out_the_last_windows():
    dataset = make_dataset(100)
    train, held_out = dataset.split(0.1)
    assert (train.num_samples, held_out.num_samples) == (90, 10)
    assert train.sample_id(89) == 89 and held_out.sample_id(0) == 90
    assert torch.equal(held_out[0][0], dataset[90][0])
    with pytest.raises(IndexError):
        held_out[10]
    with pytest.raises(UserError, match="eval_fraction"):
        dataset.split(1.0)


# --- order and cursor -----------------------------------------------------------------------


def test_order_is_a_pure_function_of_seed():
    first = take(BatchStream(make_dataset(50), batch_size=4, seed=7), 30)
    second = take(BatchStream(make_dataset(50), batch_size=4, seed=7), 30)
    other_seed = take(BatchStream(make_dataset(50), batch_size=4, seed=8), 30)
    assert_same_batches(first, second)
    assert not all(torch.equal(a.sample_ids, b.sample_ids) for a, b in zip(first, other_seed, strict=True))


def test_each_epoch_is_a_new_permutation():
    # 50 samples, batches of 4: 12 batches per epoch, the 2-sample tail is dropped.
    batches = take(BatchStream(make_dataset(50), batch_size=4, seed=1), 36)
    assert [b.epoch for b in batches] == [0] * 12 + [1] * 12 + [2] * 12
    assert [b.position for b in batches[:13]] == list(range(0, 48, 4)) + [0]
    epochs = [torch.cat([b.sample_ids for b in batches[e * 12 : (e + 1) * 12]]) for e in range(3)]
    for ids in epochs:
        assert ids.unique().numel() == 48
    assert not torch.equal(epochs[0], epochs[1])


def test_resume_from_json_cursor_continues_identically():
    uninterrupted = take(BatchStream(make_dataset(50), batch_size=4, seed=3), 30)
    first = BatchStream(make_dataset(50), batch_size=4, seed=3)
    take(first, 17)
    cursor = json.loads(json.dumps(first.state_dict()))
    assert cursor["epoch"] == 1 and cursor["position"] == 20
    resumed = BatchStream(make_dataset(50), batch_size=4, seed=3)
    resumed.load_state_dict(cursor)
    assert_same_batches(take(resumed, 13), uninterrupted[17:])


def test_cursor_after_last_batch_of_epoch_points_at_next_epoch():
    stream = BatchStream(make_dataset(50), batch_size=4, seed=3)
    take(stream, 12)
    assert (stream.state_dict()["epoch"], stream.state_dict()["position"]) == (1, 0)


@pytest.mark.parametrize("position", [0, 400, 39_996])
def test_seek_reads_only_the_delivered_samples(position):
    counting = CountingDataset(make_dataset(40_000))
    stream = BatchStream(counting, batch_size=4, seed=0)
    stream.load_state_dict({"epoch": 5, "position": position, "seed": 0, "num_samples": 40_000})
    assert counting.reads == 0
    batch = next(stream)
    assert counting.reads == 4
    assert (batch.epoch, batch.position) == (5, position)


def test_cursor_from_another_seed_or_dataset_is_refused():
    stream = BatchStream(make_dataset(50), batch_size=4, seed=3)
    with pytest.raises(UserError, match="seed=4"):
        stream.load_state_dict({"epoch": 0, "position": 0, "seed": 4, "num_samples": 50})
    with pytest.raises(UserError, match="num_samples=60"):
        stream.load_state_dict({"epoch": 0, "position": 0, "seed": 3, "num_samples": 60})


def test_without_drop_last_the_short_tail_is_delivered():
    batches = take(BatchStream(make_dataset(10), batch_size=4, seed=0, drop_last=False), 4)
    assert [len(b.sample_ids) for b in batches] == [4, 4, 2, 4]
    assert torch.cat([b.sample_ids for b in batches[:3]]).sort().values.tolist() == list(range(10))
    with pytest.raises(UserError, match="drop_last"):
        BatchStream(make_dataset(10), batch_size=2, seed=0, world_size=2, drop_last=False)


# --- ranks ----------------------------------------------------------------------------------


def test_ranks_take_disjoint_equal_slices():
    ranks = [BatchStream(make_dataset(50), batch_size=4, seed=2, rank=r, world_size=3) for r in range(3)]
    per_rank = [torch.cat([b.sample_ids for b in take(stream, 4)]) for stream in ranks]
    assert all(ids.numel() == 16 for ids in per_rank)
    assert torch.cat(per_rank).unique().numel() == 48
    assert ranks[0].state_dict() == ranks[2].state_dict() == {"epoch": 1, "position": 0, "seed": 2, "num_samples": 50}


def test_resume_with_another_world_size_sees_every_sample_once():
    dataset = make_dataset(48)
    seen = []
    two_ranks = [BatchStream(dataset, batch_size=4, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        seen += [next(stream).sample_ids for stream in two_ranks]
    cursor = two_ranks[0].state_dict()
    assert cursor == two_ranks[1].state_dict() and cursor["position"] == 24
    one_rank = BatchStream(dataset, batch_size=4, seed=5)
    one_rank.load_state_dict(cursor)
    while one_rank.state_dict()["epoch"] == 0:
        seen.append(next(one_rank).sample_ids)
    assert sorted(torch.cat(seen).tolist()) == list(range(48))


# --- workers and global RNG -----------------------------------------------------------------


def test_workers_do_not_change_the_order_or_the_cursor():
    dataset = make_dataset(30)
    in_process = take(BatchStream(dataset, batch_size=4, seed=9), 10)
    with_workers = BatchStream(dataset, batch_size=4, seed=9, num_workers=2)
    first = take(with_workers, 3)
    # Workers have prefetched beyond batch 3; the cursor counts only delivered batches.
    cursor = with_workers.state_dict()
    assert cursor["position"] == 12
    first += take(with_workers, 7)
    with_workers.close()
    assert_same_batches(first, in_process)

    resumed = BatchStream(dataset, batch_size=4, seed=9, num_workers=2)
    resumed.load_state_dict(cursor)
    assert_same_batches(take(resumed, 7), in_process[3:])
    resumed.close()


class ReaderPid(CountingDataset):
    """A sample's id is the id of the process that read it (x 1000) plus its index."""

    def sample_id(self, index: int) -> int:
        return os.getpid() * 1000 + index


def test_one_set_of_workers_serves_every_epoch():
    # Starting workers anew at each epoch made the step wait for them (ops/bench/data_wait.py).
    dataset = make_dataset(14)  # 3 batches of 4 per epoch
    in_process = take(BatchStream(dataset, batch_size=4, seed=9), 10)
    stream = BatchStream(ReaderPid(dataset), batch_size=4, seed=9, num_workers=2)
    batches = take(stream, 10)
    stream.close()
    assert [b.epoch for b in batches] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    readers = {int(i) // 1000 for b in batches for i in b.sample_ids}
    assert len(readers) == 2 and os.getpid() not in readers
    for b, expected in zip(batches, in_process, strict=True):
        assert torch.equal(b.sample_ids % 1000, expected.sample_ids) and torch.equal(b.x, expected.x)
        assert (b.epoch, b.position) == (expected.epoch, expected.position)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_leaves_global_rngs_alone(num_workers):
    torch.manual_seed(123)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    stream = BatchStream(make_dataset(30), batch_size=4, seed=9, num_workers=num_workers)
    take(stream, 9)
    stream.load_state_dict(stream.state_dict())
    next(stream)
    stream.close()
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_eval_batches_are_fixed_and_bounded():
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    batches = list(eval_batches(make_dataset(10), batch_size=4, max_batches=None))
    assert [b.sample_ids.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.position for b in batches] == [0, 4, 8]
    assert len(list(eval_batches(make_dataset(10), batch_size=4, max_batches=2))) == 2
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_data_identity_is_size_and_the_hashes_of_the_first_and_last_block(tmp_path):
    import pytest

    from harness.data import data_identity
    from harness.data.identity import BLOCK
    from harness.errors import UserError

    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * BLOCK + b"b" * 10 + b"c" * BLOCK)
    first = data_identity(str(path))
    assert first["url"] == str(path) and first["size"] == 2 * BLOCK + 10
    path.write_bytes(b"a" * BLOCK + b"x" * 10 + b"c" * BLOCK)  # the middle is not read
    assert data_identity(str(path)) == first
    path.write_bytes(b"a" * BLOCK + b"b" * 10 + b"c" * (BLOCK - 1) + b"d")
    assert data_identity(str(path))["tail"] != first["tail"]
    assert data_identity(None) == data_identity(None) and data_identity(None)["url"] is None
    with pytest.raises(UserError, match="not found"):
        data_identity(str(tmp_path / "missing.txt"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_batches_from_workers_come_pinned_for_a_cuda_device():
    stream = BatchStream(make_dataset(30), batch_size=4, seed=9, num_workers=2, pin_memory=True)
    batch = next(stream)
    stream.close()
    assert batch.x.is_pinned() and batch.y.is_pinned()
