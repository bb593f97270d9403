"""Exact elastic mode in one process: the summation tree (harness/parallel/exact.py), the exact world sizes
and the configs refused (harness/config/batch.py), the per-micro-batch streams (harness/repro/rng.py), the
clipping norm's gather. The runs across world sizes: tests/distributed/test_exact_elastic.py."""

from __future__ import annotations

import random

import pytest
import torch

from harness.config import exact_world_sizes, load_config
from harness.errors import UserError
from harness.parallel import exact
from harness.parallel.exact import SumTree
from harness.repro.rng import micro_batch_streams
from helpers import FakeGpus
from procs import ROOT, assert_one_line_error, harness

EXACT = ROOT / "tests" / "data" / "exact.toml"


def _tree_sum(leaves: list[torch.Tensor]) -> torch.Tensor:
    tree = SumTree()
    for leaf in leaves:
        tree.push(leaf.clone())
    return tree.result()


@pytest.mark.parametrize("micro_batches", [4, 6, 8, 12])
def test_blocks_summed_apart_then_combined_are_bitwise_the_whole_tree(micro_batches):
    """For every exact world size W, summing each rank's block alone and then the W block sums
    in rank order gives the bits of one process summing all V leaves; a plain left-to-right sum
    of the same leaves differs (so the tree is what makes it exact)."""
    g = torch.Generator().manual_seed(micro_batches)
    leaves = [torch.randn(1000, generator=g) * 10.0 ** torch.randint(-3, 4, (1000,), generator=g)
              for _ in range(micro_batches)]
    whole = _tree_sum(leaves)
    for world in exact_world_sizes(micro_batches):
        block = micro_batches // world
        blocks = [_tree_sum(leaves[r * block:(r + 1) * block]) for r in range(world)]
        assert torch.equal(_tree_sum(blocks), whole), world
    assert not torch.equal(sum(leaves[1:], leaves[0].clone()), whole)


def test_exact_world_sizes_are_those_whose_block_is_an_aligned_power_of_two():
    assert exact_world_sizes(4) == [1, 2, 4]
    assert exact_world_sizes(6) == [1, 3, 6]
    assert exact_world_sizes(12) == [1, 3, 6, 12]


@pytest.mark.parametrize("sets, needle", [
    (["train.global_batch=null"], "needs train.global_batch and data.batch_size set"),
    (["data.batch_size=null"], "needs train.global_batch and data.batch_size set"),  # a derived micro-batch
    (["train.grad_accum=2"], "derives train.grad_accum"),
    (["train.global_batch=9"], "not a whole number of micro-batches"),
    (["train.cpu_threads=null"], "needs train.cpu_threads set"),
])
def test_configs_exact_mode_cannot_run_are_one_line_errors(tmp_path, sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    proc = harness("train", str(EXACT), "--run-dir", str(tmp_path / "run"), "--set", "train.device=cpu", *args)
    assert_one_line_error(proc, needle)


def test_a_world_size_that_is_not_exact_is_refused_naming_the_exact_ones():
    from harness.config import batch_shape

    cfg = load_config(EXACT, ["train.global_batch=12"])  # 6 micro-batches of 2
    assert batch_shape(cfg, 3) == (2, 2)
    with pytest.raises(UserError, match="world size 2 is not exact for 6 micro-batches .* are 1, 3, 6"):
        batch_shape(cfg, 2)


def test_micro_batch_streams_depend_on_step_and_index_only_and_restore_the_process_streams():
    torch.manual_seed(7)
    random.seed(7)
    before = torch.get_rng_state(), random.getstate()
    with micro_batch_streams(1, 3, torch.device("cpu")) as use:
        use(2)
        first = torch.rand(4), random.random()
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    torch.rand(100)  # the process's own streams moved on: the micro-batch's must not care
    with micro_batch_streams(1, 3, torch.device("cpu")) as use:
        use(1)
        torch.rand(50)  # nor what an earlier micro-batch of the block drew
        use(2)
        again = torch.rand(4), random.random()
    with micro_batch_streams(1, 3, torch.device("cpu")) as use:
        use(1)
        other = torch.rand(4)
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and not torch.equal(first[0], other)


def test_micro_batch_streams_restore_the_ranks_own_gpu_stream(monkeypatch):
    """On a GPU the block puts back the stream of the rank's device (the one its dropout draws
    from), whatever another device's generator holds; faked GPUs (tests/helpers.py)."""
    gpus = FakeGpus(monkeypatch, 2)
    gpus.set(torch.full((16,), 33, dtype=torch.uint8), 1)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: [gpus.set(torch.full((16,), seed % 256,
                                                                                  dtype=torch.uint8), i)
                                                                       for i in range(2)])
    with micro_batch_streams(1, 3, torch.device("cuda", 1)) as use:
        use(0)
        assert not torch.equal(gpus.states[1], torch.full((16,), 33, dtype=torch.uint8))
    assert torch.equal(gpus.states[1], torch.full((16,), 33, dtype=torch.uint8))


def test_every_rank_gathers_the_clipping_rows_on_its_training_device_with_or_without_gradients(monkeypatch):
    """Under FSDP each rank's gradient rows meet in one all-gather: every rank enters it (a rank
    holding no gradient too: one left out would hold the others there), its vector float64 on the
    rank's training device (NCCL gathers only GPU tensors) and of the same length on every rank."""
    calls = []

    def all_gather(out, t):
        calls.append((t.device, t.dtype, t.numel()))
        for o in out:
            o.copy_(t)

    monkeypatch.setattr(exact.dist, "all_gather", all_gather)
    device = torch.device("cpu")
    assert exact.clip_gradients([], 1.0, 2, device=device, sharded=True) == 0.0
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.full((3, 2), 2.0)
    assert exact.clip_gradients([p], 100.0, 2, device=device, sharded=True) == pytest.approx((2 * 24) ** 0.5)
    assert calls == [(device, torch.float64, 0), (device, torch.float64, 3)]
    exact.clip_gradients([p], 100.0, 2, device=device, sharded=False)  # replicated gradients: no gather
    assert len(calls) == 2
