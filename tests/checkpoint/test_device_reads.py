"""device_bytes (harness/checkpoint/device_reads.py): a state's bytes read by the host in batches of
at most one piece, one copy per batch whatever the number of tensors, every byte in order, the
digests the same as of the tensors read whole. Run on host tensors here (the same path without
streams); on a GPU, ops/gpu_check.sh counts the device-to-host copies and waits."""

from __future__ import annotations

from collections import Counter

import torch
import xxhash
from torch.overrides import TorchFunctionMode

from harness.checkpoint.device_reads import batches, device_bytes
from harness.checkpoint.tensorfile import tensor_bytes


class Counted(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def test_batches_pack_small_tensors_and_cut_large_ones():
    assert batches([10, 100, 3, 0, 250, 7], 64) == [
        [(0, 0, 10), (1, 0, 54)], [(1, 54, 100), (2, 0, 3), (4, 0, 15)], [(4, 15, 79)], [(4, 79, 143)],
        [(4, 143, 207)], [(4, 207, 250), (5, 0, 7)]]
    assert batches([0, 0], 64) == []


def test_every_byte_arrives_in_order_in_one_copy_per_batch():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=g), torch.tensor(True), torch.empty(0), torch.randn(3, 5, generator=g).t(),
               torch.arange(40_000, dtype=torch.int64), torch.randn(7, generator=g).half()]
    piece = 64 << 10
    expected = [bytes(tensor_bytes(t)) for t in tensors]
    got = [b""] * len(tensors)
    with Counted() as counted:
        for index, view in device_bytes(tensors, piece):
            got[index] += bytes(view)
    assert got == expected
    assert counted.calls["copy_"] == len(batches([len(b) for b in expected], piece)) == 5  # 6 tensors, 320 KiB
    hashed = [xxhash.xxh3_64() for _ in tensors]
    for index, view in device_bytes(tensors, piece):
        hashed[index].update(view)  # what the state hash does: each piece read before the next is asked for
    assert [h.hexdigest() for h in hashed] == [xxhash.xxh3_64(b).hexdigest() for b in expected]
