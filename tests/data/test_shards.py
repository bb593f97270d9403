"""Training on token shards: reading, mixing by weight, one global order, config checks."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.config import RunConfig, batch_shape, load_config
from harness.data import BatchStream, TokenDataset
from harness.data.mixture import SOURCE_ID_STRIDE, Mixture
from harness.data.prepare import PrepareSpec, prepare
from harness.data.shard_reader import ShardReader
from harness.data.sources import identity_changes, open_data
from harness.errors import UserError
from procs import TINY

SEQ = 8


def make_dataset(folder: Path, text: str, shard_tokens: int = 50) -> str:
    (folder.parent / f"{folder.name}.txt").write_text(text)
    prepare(PrepareSpec((str(folder.parent / f"{folder.name}.txt"),), "bytes", text_split="line",
                        shard_tokens=shard_tokens), str(folder))
    return str(folder)


@pytest.fixture
def two_sources(tmp_path) -> tuple[str, str]:
    a = make_dataset(tmp_path / "a", "".join(f"alpha document {i}\n" for i in range(40)))
    b = make_dataset(tmp_path / "b", "".join(f"beta {i} text\n" for i in range(25)), shard_tokens=33)
    return a, b


def flat_tokens(url: str) -> np.ndarray:
    reader = ShardReader.open(url)
    return np.concatenate([np.fromfile(Path(url) / s.name, dtype="<u2") for s in reader.index.shards])


def test_reader_ranges_cross_shard_boundaries(two_sources):
    url = two_sources[0]
    reader, tokens = ShardReader.open(url), flat_tokens(url)
    starts = [0, 45, 49, 95, len(tokens) - 12]  # 49..60 and 95..106 cross shard boundaries
    got = reader.read_windows(starts, 12)
    assert got.dtype == np.int64 and got.shape == (5, 12)
    for row, start in zip(got, starts, strict=True):
        assert np.array_equal(row, tokens[start:start + 12])
    with pytest.raises(IndexError):
        reader.read_windows([len(tokens) - 1], 2)


def test_reader_pickles_without_its_files(two_sources):
    reader = ShardReader.open(two_sources[0])
    reader.read_windows([0], 200)
    assert reader._files and reader._checked == {0, 1, 2, 3}
    copy = pickle.loads(pickle.dumps(reader))
    assert not copy._files and copy._checked == reader._checked  # first-open: no second hash in workers
    always = ShardReader.open(two_sources[0], hash_check="always")
    always.read_windows([0], 200)
    assert pickle.loads(pickle.dumps(always))._checked == set()  # always: every process hashes again
    assert len(pickle.dumps(reader)) < 4096


@pytest.mark.parametrize("hash_check, caught", [("first-open", True), ("always", True), ("off", False)])
def test_hash_check_catches_a_corrupt_shard_on_open(two_sources, hash_check, caught):
    url = two_sources[0]
    shard = Path(url) / "shard-000001.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    reader = ShardReader.open(url, hash_check=hash_check)
    if caught:
        with pytest.raises(UserError, match="shard-000001.bin is corrupt"):
            reader.read_windows([40], 20)
    else:
        reader.read_windows([40], 20)


def test_sizes_are_checked_even_without_hashes(two_sources):
    url = two_sources[0]
    (Path(url) / "shard-000002.bin").write_bytes(b"\x00\x00")
    with pytest.raises(UserError, match="shard-000002.bin is 2 bytes"):
        ShardReader.open(url, hash_check="off").read_windows([100], 10)


def test_mixture_draws_by_weight_and_covers_a_small_share_over_epochs(two_sources):
    a, b = (TokenDataset(ShardReader.open(u), SEQ) for u in two_sources)
    mix = Mixture([a, b], [0.9, 0.1], seed=3)
    assert mix.num_samples == a.num_samples + b.num_samples
    assert mix.counts[0] + mix.counts[1] == mix.num_samples
    assert abs(mix.counts[1] - 0.1 * mix.num_samples) <= 1
    seen_b: set[int] = set()
    for epoch in range(-(-b.num_samples // mix.counts[1])):
        view = mix.for_epoch(epoch)
        sources = Counter(view.locate(i)[0] for i in range(mix.num_samples))
        assert sources == {0: mix.counts[0], 1: mix.counts[1]}
        seen_b |= {view.locate(i)[1] for i in range(mix.num_samples) if view.locate(i)[0] == 1}
    assert seen_b == set(range(b.num_samples))  # the down-weighted source is seen whole over epochs
    ids = {mix.sample_id(i) for i in range(mix.num_samples)}
    assert {i // SOURCE_ID_STRIDE for i in ids} == {0, 1}
    again = Mixture([a, b], [0.9, 0.1], seed=3).for_epoch(1)
    assert [again.sample_id(i) for i in range(20)] == [mix.for_epoch(1).sample_id(i) for i in range(20)]
    x, y = mix[5]
    assert torch.equal(mix.windows([5])[0], torch.cat([x, y[-1:]]))


def _global_batches(dataset, per_rank: int, world: int, workers: int, steps: int) -> list[list[int]]:
    """Each step's sample ids in cursor order, ranks interleaved as the trainer gathers them."""
    streams = [BatchStream(dataset, per_rank, seed=5, rank=r, world_size=world, num_workers=workers)
               for r in range(world)]
    out = []
    for _ in range(steps):
        rows = [next(s).sample_ids for s in streams]
        out.append(torch.stack(rows, dim=1).reshape(-1).tolist())
    for s in streams:
        s.close()
    return out


def test_global_batches_do_not_depend_on_world_size_or_workers(two_sources):
    a, b = (TokenDataset(ShardReader.open(u), SEQ) for u in two_sources)
    mix = Mixture([a, b], [0.7, 0.3], seed=5)
    steps = mix.num_samples // 8 + 3  # crosses an epoch boundary
    reference = _global_batches(mix, 8, 1, 0, steps)
    assert _global_batches(mix, 4, 2, 0, steps) == reference
    assert _global_batches(mix, 2, 4, 2, steps) == reference
    assert len({tuple(x) for x in reference}) == len(reference)


def test_batch_shape_derives_the_unset_one(tmp_path):
    cfg = load_config(TINY, ["train.global_batch=16"])  # tiny sets batch_size 4 and grad_accum 2
    with pytest.raises(UserError, match="train.global_batch = 16 does not split over 1 rank"):
        batch_shape(cfg, 1)
    assert batch_shape(cfg, 2) == (4, 2)
    cfg = RunConfig.model_validate({"data": {"batch_size": 4}, "train": {"global_batch": 16}})
    assert batch_shape(cfg, 1) == (4, 4) and batch_shape(cfg, 2) == (4, 2) and batch_shape(cfg, 4) == (4, 1)
    with pytest.raises(UserError, match="make global_batch a multiple of data.batch_size x world size"):
        batch_shape(cfg, 3)
    cfg = RunConfig.model_validate({"train": {"global_batch": 24, "grad_accum": 3}})
    assert batch_shape(cfg, 2) == (4, 3)
    assert batch_shape(RunConfig(), 2) == (16, 1)  # no global_batch: as before


def test_url_and_sources_together_is_a_config_error(tmp_path):
    with pytest.raises(UserError, match="set one of url .*, sources .* or factory .*, not url and sources"):
        load_config(TINY, ["data.url=x.txt", 'data.sources=[{url = "d"}]'])


def test_identity_and_vocab(two_sources, tmp_path):
    cfg = load_config(TINY, [f'data.sources=[{{url = "{two_sources[0]}", weight = 2.0}}, {{url = "{two_sources[1]}"}}]',
                             "data.seq_len=8"])
    data = open_data(cfg.data, 0)
    assert data.vocab_size == 257
    same = open_data(cfg.data, 0).identity
    assert identity_changes(data.identity, same) == {}
    cfg.data.sources[0].weight = 3.0
    assert identity_changes(data.identity, open_data(cfg.data, 0).identity) == {"data.sources[0] weight": (2.0, 3.0)}
    other = make_dataset(tmp_path / "c", "gamma\n" * 30)
    cfg.data.sources[0].weight = 2.0
    cfg.data.sources[1].url = other
    changes = identity_changes(data.identity, open_data(cfg.data, 0).identity)
    assert list(changes) == ["data.sources[1] index sha256", "data.sources[1] training windows (the eval split)"]


def test_the_split_is_in_the_identity_and_a_resume_under_the_old_rule_is_refused(two_sources):
    """A checkpoint of a harness that held out eval_fraction of the documents records no training
    window count: its resume is refused, naming the split, not run on other training windows."""
    from harness.config import public_config
    from harness.run.resume import check_compatible

    cfg = load_config(TINY, [f'data.sources=[{{url = "{two_sources[0]}"}}]', "data.seq_len=8"])
    data = open_data(cfg.data, 0)
    assert data.identity["sources"][0]["train_windows"] == data.train.num_samples
    old = {"sources": [{k: v for k, v in data.identity["sources"][0].items() if k != "train_windows"}]}
    meta = {"config": public_config(cfg), "data": old}
    with pytest.raises(UserError, match=r"data.sources\[0\] training windows \(the eval split\) differ"):
        check_compatible(meta, cfg, False, data.identity)
    allowed = check_compatible(meta, cfg, True, data.identity)
    assert list(allowed) == ["data.sources[0] training windows (the eval split)"]
    assert check_compatible({**meta, "data": data.identity}, cfg, False, data.identity) == {}


def test_sources_of_different_tokenizers_are_refused(two_sources, tmp_path):
    (tmp_path / "t.txt").write_text("some text for a tokenizer\n" * 20)
    bpe = str(tmp_path / "bpe")
    prepare(PrepareSpec((str(tmp_path / "t.txt"),), "train-bpe:300"), bpe)
    cfg = load_config(TINY, [f'data.sources=[{{url = "{two_sources[0]}"}}, {{url = "{bpe}"}}]', "data.seq_len=8"])
    with pytest.raises(UserError, match="2 different tokenizers"):
        open_data(cfg.data, 0)
    cfg = load_config(TINY, [f'data.sources=[{{url = "{two_sources[0]}"}}]', f'data.eval_sources=[{{url = "{bpe}"}}]'])
    with pytest.raises(UserError, match="2 different tokenizers"):
        open_data(cfg.data, 0)


def test_eval_sources_are_read_whole_and_training_keeps_every_document(two_sources):
    a, b = two_sources
    cfg = load_config(TINY, [f'data.sources=[{{url = "{a}"}}]', f'data.eval_sources=[{{url = "{b}"}}]',
                             "data.seq_len=8"])
    data = open_data(cfg.data, 0)
    assert data.train.num_samples == (len(flat_tokens(a)) - 1) // 8
    assert data.eval.num_samples == (len(flat_tokens(b)) - 1) // 8
    assert {data.eval.sample_id(i) for i in range(data.eval.num_samples)} == set(range(data.eval.num_samples))
    with pytest.raises(UserError, match="eval_sources needs sources"):
        load_config(TINY, [f'data.eval_sources=[{{url = "{b}"}}]'])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_missing_shard_is_one_line_even_from_a_worker(two_sources, workers):
    a = TokenDataset(ShardReader.open(two_sources[0]), SEQ)
    (Path(two_sources[0]) / "shard-000001.bin").unlink()
    stream = BatchStream(a, a.num_samples // 2, seed=0, num_workers=workers)
    with pytest.raises(UserError) as caught:
        next(stream)
    assert "shard-000001.bin is missing" in str(caught.value) and "\n" not in str(caught.value)


def test_eval_is_eval_fraction_of_the_windows_cut_at_a_document_end(two_sources):
    from harness.data.document_split import split_by_document

    reader = ShardReader.open(two_sources[0])  # 40 lines "alpha document N", one document each
    tokens = flat_tokens(two_sources[0])
    windows = (len(tokens) - 1) // SEQ
    train, held_out = split_by_document(reader, SEQ, 0.3)  # 28 windows: the cut may move 22 tokens, a document is 19
    assert abs(held_out.num_samples - 0.3 * windows) <= 0.1 * 0.3 * windows + 1
    last_train = (train.sample_id(train.num_samples - 1) + 1) * SEQ + 1
    first_eval = held_out.sample_id(0) * SEQ
    ends = np.flatnonzero(tokens == 256) + 1
    boundary = int(ends[(ends >= last_train) & (ends <= first_eval)][0])  # a document ends between them
    assert first_eval - boundary < SEQ and boundary - last_train < SEQ
    assert held_out.sample_id(held_out.num_samples - 1) == windows - 1
    inputs = held_out.windows(list(range(held_out.num_samples)))[:, :-1]  # the windows share one token
    text = bytes(t for t in inputs.flatten().tolist() if t != 256)
    last_training_document = int(np.searchsorted(ends, boundary))  # 0-based: "alpha document N"
    assert f" {last_training_document + 1}\n".encode() in text[:SEQ + 4]
    assert f" {last_training_document}\n".encode() not in text
    assert b"alpha document 38\n" in text
    with pytest.raises(UserError, match="leaves no training or no eval windows"):
        split_by_document(reader, SEQ, 0.999)


def test_eval_of_a_few_long_documents_is_eval_fraction_of_the_windows(tmp_path):
    """Two input files as two documents (`--text-split file`): the eval set was the whole second
    file, about half the data; it is eval_fraction of the windows, the second document's tail."""
    from harness.data.document_split import split_by_document

    (tmp_path / "a.txt").write_text("".join(f"first file, line {i}\n" for i in range(300)))
    (tmp_path / "b.txt").write_text("".join(f"second file, line {i}\n" for i in range(250)))
    prepare(PrepareSpec((str(tmp_path / "a.txt"), str(tmp_path / "b.txt")), "bytes"), str(tmp_path / "ds"))
    reader = ShardReader.open(str(tmp_path / "ds"))
    windows = (len(reader) - 1) // SEQ
    train, held_out = split_by_document(reader, SEQ, 0.05)
    assert held_out.num_samples == -(-5 * windows // 100) and train.num_samples == windows - held_out.num_samples
    assert held_out.sample_id(0) == train.num_samples  # cut inside the second document, no window lost
    text = bytes(t for t in held_out.windows(list(range(held_out.num_samples)))[:, :-1].flatten().tolist() if t != 256)
    assert b"first file" not in text and b"second file, line 248\n" in text


@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_stream_resumes_across_epochs_in_o1(two_sources, workers):
    """Cursor saved at every step over two epochs of a 0.8/0.2 mixture; a fresh stream loaded
    from it delivers exactly the batches the continuous one did (sample ids and tokens)."""
    a, b = (TokenDataset(ShardReader.open(u), SEQ) for u in two_sources)
    mix = Mixture([a, b], [0.8, 0.2], seed=9)
    continuous = BatchStream(mix, 6, seed=9, num_workers=workers)
    steps = 2 * (mix.num_samples // 6) + 2
    cursors, batches = [], []
    for _ in range(steps):
        cursors.append(continuous.state_dict())
        batches.append(next(continuous))
    assert batches[-1].epoch == 2
    for k in (1, steps // 2 + 1, steps - 3):
        resumed = BatchStream(Mixture([a, b], [0.8, 0.2], seed=9), 6, seed=9, num_workers=workers)
        resumed.load_state_dict(cursors[k])
        for expected in batches[k:k + 3]:
            got = next(resumed)
            assert torch.equal(got.sample_ids, expected.sample_ids) and torch.equal(got.x, expected.x)
        resumed.close()
    continuous.close()


def _read_in_child(reader: ShardReader, queue) -> None:
    queue.put((reader.read_windows([0, 90], 20).tolist(), reader._pid))


def test_a_forked_process_reopens_what_the_parent_had_open(two_sources):
    """DataLoader workers are forked, not handed a pickle: the reader must not use the parent's
    descriptors or filesystem (s3fs refuses its parent's event loop: tests/data/test_shards_s3.py)."""
    import multiprocessing
    import os

    reader = ShardReader.open(two_sources[0])
    expected = reader.read_windows([0, 90], 20).tolist()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(reader, queue))
    child.start()
    got, child_pid = queue.get(timeout=60)
    child.join(60)
    assert got == expected and child_pid not in (None, os.getpid()) and reader._pid == os.getpid()
