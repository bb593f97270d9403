"""A GPU state's bytes read by the host in bounded pieces: `device_bytes`, what the fingerprints'
state hash reads of tensors on a GPU (repro/fingerprint.py: every `fingerprint_every` steps, after
each resume, at a save for the tensors no staging copies).

Before, each GPU tensor was copied whole into fresh pageable memory by a blocking copy: a host
sync, an allocation and its page faults per tensor, and the hash waited for every copy. Here the
tensors' bytes are cut into batches of `PIECE_BYTES` (small tensors packed together on the device
by one concatenation, a large one in slices), each copied by one device-to-host copy on a side
stream into one of two pinned pieces of host memory, the next batch copied while the caller reads
the last: one copy and one (sleeping) wait per batch, whatever the number of tensors. The side
stream waits for the kernels queued before the call, so the bytes are the state at the call.
Tensors on the CPU take the same path without streams (what tests check on a machine without GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import torch

from harness.checkpoint.host_memory import HostBlock, copies_done

PIECE_BYTES = 64 << 20

Batch = list[tuple[int, int, int]]  # (tensor index, first byte, end byte) ranges, copied together

_slots = threading.local()  # each thread's two pieces of host memory, kept for its next reads


def batches(sizes: Sequence[int], piece_bytes: int = PIECE_BYTES) -> list[Batch]:
    """Byte ranges of tensors of `sizes` bytes, in order, in batches of `piece_bytes` at most,
    each batch filled before the next begins (a tensor may end in the next batch)."""
    out: list[Batch] = []
    room = 0
    for index, size in enumerate(sizes):
        at = 0
        while at < size:
            if room == 0:
                out.append([])
                room = piece_bytes
            n = min(room, size - at)
            out[-1].append((index, at, at + n))
            at += n
            room -= n
    return out


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor where it lies (a copy only where it is not dense)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _host_slots(piece_bytes: int, pinned: bool) -> torch.Tensor:
    block: HostBlock | None = getattr(_slots, "block", None)
    if block is None or block.nbytes != 2 * piece_bytes or block.pinned != pinned:
        if block is not None:
            block.release()
        block = _slots.block = HostBlock(2 * piece_bytes, pinned)
    assert block.tensor is not None
    return block.tensor


def device_bytes(tensors: Sequence[torch.Tensor], piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[int, memoryview]]:
    """Every byte of `tensors` (all on one device), in order, as (tensor index, piece of its bytes);
    an empty tensor gives none. A piece may be read until the caller asks for the one after the
    next batch's first, so read each before going on (module docstring)."""
    flats = [flat_bytes(t) for t in tensors]
    plan = batches([f.numel() for f in flats], piece_bytes)
    if not plan:
        return
    device = flats[0].device
    side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # after the kernels that made the state (and `flats`)
        for flat in flats:
            flat.record_stream(side)  # a dense copy made above must outlive the side stream's reads
    slots = _host_slots(piece_bytes, pinned=side is not None)
    ready: list[torch.cuda.Event | None] = [None, None]

    def issue(k: int) -> None:
        ranges = plan[k]
        n = sum(end - start for _, start, end in ranges)
        slot = slots[k % 2 * piece_bytes:k % 2 * piece_bytes + n]
        with torch.cuda.stream(side) if side is not None else nullcontext():
            src = (flats[ranges[0][0]][ranges[0][1]:ranges[0][2]] if len(ranges) == 1
                   else torch.cat([flats[i][start:end] for i, start, end in ranges]))
            slot.copy_(src, non_blocking=side is not None)
        ready[k % 2] = copies_done(side) if side is not None else None

    issue(0)
    for k in range(len(plan)):
        if k + 1 < len(plan):
            issue(k + 1)  # into the slot of batch k - 1, which the caller has read: it asked for batch k
        event = ready[k % 2]
        if event is not None:
            event.synchronize()
        at = k % 2 * piece_bytes
        for index, start, end in plan[k]:
            yield index, memoryview(slots[at:at + end - start].numpy())  # type: ignore[arg-type]  # numpy stubs
            at += end - start
