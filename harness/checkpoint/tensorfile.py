"""Safetensors files, written and read by this harness itself, never through pickle.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}}`, padded with spaces to a multiple of
8), then the raw little-endian tensor bytes, packed without gaps. Files written here are readable
by the `safetensors` library and any other reader of the format.

Why not `safetensors.torch.save` / `safe_open`:
* saving: the library builds the whole file as one `bytes` object (a second copy of the state)
  before writing; here each tensor's own memory is streamed to the file (and to the hasher).
* loading: `safe_open` maps the file and returns a *new* tensor per name, which the caller then
  copies into the live one: the mapped pages count in RSS and every tensor is copied twice.
  `read_tensor(..., out=live)` reads the bytes straight into the live tensor's storage with
  `readinto`, so resuming needs no memory beyond what the live state already holds, and the same
  code reads from local disk, `memory://` or S3 (fsspec file objects). A live tensor on a GPU is
  read into through a few lent pinned pieces, each copied to the device asynchronously while the
  next is read (host_memory.py), not whole into fresh pageable memory and a blocking copy.

Tensor order in a file is by name, and the header carries no metadata or timestamp, so the same
tensors always give the same bytes. The reader validates everything before trusting it: header
length against the file size (a pickle or zip renamed to .safetensors fails here), JSON shape,
known dtypes, sizes that match shapes, offsets that tile the data exactly.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.host_memory import LentPieces, copies_done

if sys.byteorder != "little":  # the format is little-endian; tensors are written as they lie in memory
    raise ImportError("harness.checkpoint supports little-endian hosts only")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# A header describes names and shapes; even a million tensors stay far below this.
MAX_HEADER_BYTES = 100 << 20
# The most bytes of a tensor written or read in one call: the hash that runs behind the writes
# and reads (storage/location.py, `BackgroundHash`) then follows them piece by piece, however
# large a tensor (a 1 GiB embedding hashed whole would have waited for its write, or its read).
PIECE_BYTES = 16 << 20


class Readable(Protocol):
    """A binary file open for reading (a local or fsspec file, a `HashingReader`): what
    `read_header` and `read_tensor` use of it."""

    def seek(self, pos: int, /) -> int: ...

    def read(self, n: int, /) -> bytes: ...

    def readinto(self, view: memoryview, /) -> int | None: ...


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a file; `start`/`end` are absolute byte offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


Opened = tuple[Readable, dict[str, TensorEntry], str]
"""A tensor file opened for reading: (reader, header entries, its URL for messages)."""


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat view, without a copy when it is a dense CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    # numpy's stubs give ndarray `__buffer__` for Python >= 3.12 only (mypy checks as 3.11)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class ChunkedTensors(Mapping[str, torch.Tensor]):
    """The tensors of one file whose bytes arrive in chunks, `chunks(name)` asked for in the file's
    name order, instead of being read from the tensors, which are meta tensors (names, dtypes and
    shapes only): a background save streaming through bounded staging memory
    (checkpoint/save/staging_ring.py)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], chunks: Callable[[str], Iterable[memoryview]]) -> None:
        self._tensors, self.chunks = dict(tensors), chunks

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def serialize(tensors: Mapping[str, torch.Tensor], where: str) -> Iterator[memoryview | bytes]:
    """The file's bytes in order: header, then each tensor (sorted by name), one at a time (or, for
    `ChunkedTensors`, its chunks)."""
    for name, t in tensors.items():
        if t.layout != torch.strided or t.dtype not in CODES:
            raise CheckpointError(
                f"{where}: tensor {name!r} is {t.dtype} ({t.layout}); checkpoints store dense tensors "
                f"of {', '.join(sorted(str(d).removeprefix('torch.') for d in CODES))}: convert it in state_dict()"
            )
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    if isinstance(tensors, ChunkedTensors):
        yield from _file(specs, tensors.chunks)
    else:
        yield from stream(specs, tensors.__getitem__)


def stream(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
           produce: Callable[[str], torch.Tensor]) -> Iterator[memoryview | bytes]:
    """A file of the tensors `specs` describes (name -> (dtype, shape)): the header, then each
    tensor's bytes, asking `produce(name)` for one tensor at a time in name order, so a file can
    be written from tensors that are built one by one (ckpt consolidate) and never all held."""
    yield from _file(specs, lambda name: (tensor_bytes(produce(name)),))


def _file(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
          chunks: Callable[[str], Iterable[memoryview | bytes]]) -> Iterator[memoryview | bytes]:
    offset = 0
    header: dict[str, dict[str, Any]] = {}
    names = sorted(specs)
    for name in names:
        dtype, shape = specs[name]
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for name in names:
        if math.prod(specs[name][1]):
            for chunk in chunks(name):
                yield from pieces(chunk)


def pieces(chunk: memoryview | bytes) -> Iterator[memoryview | bytes]:
    """`chunk` in views of `PIECE_BYTES` at most (no copy)."""
    view = memoryview(chunk).cast("B")
    if view.nbytes <= PIECE_BYTES:
        yield chunk
        return
    for at in range(0, view.nbytes, PIECE_BYTES):
        yield view[at:at + PIECE_BYTES]


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def read_header(f: Readable, file_size: int, where: str) -> dict[str, TensorEntry]:
    """Parse and validate the header of the safetensors file open in `f` (`file_size` bytes).

    Raises `CheckpointError` naming `where` for anything that is not a well-formed file.
    """
    if file_size < 8:
        raise CheckpointError(f"{where}: {file_size} bytes is too short for a safetensors file; it is truncated")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n < 2 or n > min(MAX_HEADER_BYTES, file_size - 8):
        raise CheckpointError(
            f"{where}: header length {n} is impossible in a file of {file_size} bytes; this is not a "
            f"safetensors file (a pickle or torch.save file renamed?) or it is truncated. It was not loaded"
        )
    raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(doc, dict):
            raise ValueError("the header is not a JSON object")
        doc.pop("__metadata__", None)
        entries = [_entry(name, spec, 8 + n) for name, spec in doc.items()]
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"{where}: malformed safetensors header ({e}); the file is corrupt or not safetensors"
        ) from e
    data_end = 8 + n
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != data_end:
            raise CheckpointError(f"{where}: tensor {entry.name!r} starts at byte {entry.start}, expected {data_end}; "
                                  "the header is corrupt")
        data_end = entry.end
    if data_end != file_size:
        raise CheckpointError(
            f"{where}: the header describes {data_end} bytes but the file has {file_size}; the file is "
            f"{'truncated' if data_end > file_size else 'followed by unexpected bytes'}"
        )
    return {e.name: e for e in entries}


def _entry(name: str, spec: dict[str, Any], base: int) -> TensorEntry:
    if spec["dtype"] not in DTYPES:
        raise ValueError(f"tensor {name!r} has unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    ints = shape + offsets if isinstance(shape, list) and isinstance(offsets, list) else None
    if ints is None or len(offsets) != 2 or not all(type(x) is int and x >= 0 for x in ints):
        raise ValueError(f"tensor {name!r} has a malformed shape or data_offsets")
    dtype = DTYPES[spec["dtype"]]
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes cannot hold {spec['dtype']}{shape}")
    return TensorEntry(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def read_tensor(f: Readable, entry: TensorEntry, where: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor; into `out`'s storage when it is a dense CPU tensor (no extra memory), into
    a dense GPU tensor through pinned pieces (`_read_into_device`), otherwise into a new tensor that
    is then copied into `out` (if given). Returns the result."""
    dense = out is not None and out.is_contiguous() and not out.is_conj() and not out.is_neg()
    if out is not None and dense and out.is_cuda:
        _read_into_device(f, entry, where, out.detach())
        return out
    direct = out is not None and dense and out.device.type == "cpu"
    buf = out.detach() if out is not None and direct else torch.empty(entry.shape, dtype=entry.dtype)
    if entry.end > entry.start:
        f.seek(entry.start)
        _fill(f, memoryview(buf.reshape(-1).view(torch.uint8).numpy()), entry, where)  # type: ignore[arg-type]
    if out is None:
        return buf
    if not direct:
        with torch.no_grad():
            out.copy_(buf)
    return out


def _fill(f: Readable, view: memoryview, entry: TensorEntry, where: str) -> None:
    """Read `len(view)` bytes of `entry` from `f` into `view`, in pieces of `PIECE_BYTES` at most."""
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos:pos + PIECE_BYTES])
        if not got:
            raise CheckpointError(f"{where}: file ended inside tensor {entry.name!r}; it is truncated")
        pos += got


_device_pieces: LentPieces | None = None
_device_pieces_made = threading.Lock()


def _read_into_device(f: Readable, entry: TensorEntry, where: str, out: torch.Tensor) -> None:
    """`entry` read into the dense GPU tensor `out` piece by piece: each piece read into pinned host
    memory, then copied to the device asynchronously on the current stream (what uses `out` next
    runs after the copies), while the next piece is read. A piece is read into again only once its
    copy is done and nothing holds it (a hash behind the reads: host_memory.LentPieces). Before,
    a tensor was read whole into fresh pageable memory and copied by a blocking copy."""
    global _device_pieces
    with _device_pieces_made:
        if _device_pieces is None:
            _device_pieces = LentPieces(4, PIECE_BYTES, pinned=True)
        pieces = _device_pieces
    flat = out.reshape(-1).view(torch.uint8)
    stream = torch.cuda.current_stream(out.device)
    if entry.end > entry.start:
        f.seek(entry.start)
    for at in range(0, flat.numel(), PIECE_BYTES):
        view, piece, copied = pieces.borrow(min(PIECE_BYTES, flat.numel() - at))
        _fill(f, view, entry, where)
        flat[at:at + len(view)].copy_(piece, non_blocking=True)
        copied(copies_done(stream))
        del view, piece  # the piece is lent again once the reader's hash lets go of it too
