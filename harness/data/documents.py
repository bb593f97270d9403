"""The documents of `harness data prepare`'s inputs, in a fixed order.

An input is a local path or fsspec URL. `.parquet` and `.arrow` files and folders saved by the
`datasets` library's `save_to_disk` are columnar (columnar.py): each row's value in the `field`
column is a document. Otherwise `.gz` and `.zst` are decompressed on the fly, and the format
comes from the name without that suffix: `.jsonl`, `.ndjson` and `.json` are JSON lines (one
object per line, the document is its `field`; what `load_dataset("json", data_files=...)` reads),
anything else is UTF-8 text: one document per file (`text_split="file"`) or one per non-empty
line (`"line"`). `builtin:corpus` is the built-in corpus (`corpus.py`), one document per
paragraph (line). An empty document (an empty file, an empty JSON text or row value) is no
document: it would be an end-of-document token alone.

The order is the inputs' order, then the order inside each, so the document stream, and the
token stream made from it, is a pure function of the inputs: what a restarted prepare relies on.
Anything that is not what it claims (binary data, invalid UTF-8, a JSON line without the field, a
damaged parquet file, a column that does not hold strings) is a UserError naming the file and
line or row; `check_inputs` finds what can be found without reading the documents (a columnar
input's text column) before prepare writes anything.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
from collections.abc import Iterator
from typing import Any, BinaryIO, Literal

from harness.data import columnar
from harness.data.corpus import default_corpus
from harness.data.identity import data_identity, file_identity
from harness.errors import UserError
from harness.storage.filesystem import open_filesystem

BUILTIN_CORPUS = "builtin:corpus"
TextSplit = Literal["file", "line"]
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
_CHUNK = 1 << 20


def iter_documents(inputs: list[str], *, field: str = "text", text_split: TextSplit = "file",
                   storage_options: dict | None = None) -> Iterator[str]:
    """Every document of every input, in order (see the module docstring)."""
    for url in inputs:
        if url == BUILTIN_CORPUS:
            yield from (line for line in default_corpus().decode("ascii").splitlines() if line)
            continue
        if (files := _columnar_files(url, storage_options)) is not None:
            with _input_errors(url):
                yield from columnar.documents(files, field, storage_options)
            continue
        with _open_text(url, storage_options) as lines:
            if _base_name(url).endswith(_JSON_SUFFIXES):
                yield from _json_documents(url, lines, field)
            elif text_split == "line":
                yield from (text for _, text in _checked_lines(url, lines) if text.strip())
            elif document := "".join(line for _, line in _checked_lines(url, lines)):
                yield document


def check_inputs(inputs: list[str], *, field: str = "text", storage_options: dict | None = None) -> None:
    """Raise the UserError reading would raise for what can be seen without reading any document:
    a missing columnar input, a save_to_disk folder without its arrow files, a text column that
    is not there or holds no strings, a parquet file whose footer is damaged."""
    for url in inputs:
        if url != BUILTIN_CORPUS and (files := _columnar_files(url, storage_options)) is not None:
            with _input_errors(url):
                columnar.check_text_column(files, field, storage_options)


def _columnar_files(url: str, storage_options: dict | None) -> list[str] | None:
    with _input_errors(url):
        return columnar.data_files(url, storage_options)


def _base_name(url: str) -> str:
    for suffix in (".gz", ".zst"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


@contextlib.contextmanager
def _open_text(url: str, storage_options: dict | None) -> Iterator[io.TextIOBase]:
    """The input's lines, decoded strictly as UTF-8; a byte that is not UTF-8 is a UserError
    naming its line and byte offset (found by reading the input again: error path only)."""
    with _open_binary(url, storage_options) as stream:
        try:
            yield io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline="")
        except UnicodeDecodeError as e:
            line, offset = _undecodable_position(url, storage_options)
            raise UserError(f"input {url} is not UTF-8 text (line {line}, byte offset {offset}: {e.reason}); pass "
                            f"text or JSON lines, compressed only as .gz or .zst") from None


def input_identity(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The input's size and the sha256 of its first and last MiB, as the training data's identity
    takes them (identity.py): what a resumed prepare compares to see an input changed. A
    save_to_disk folder's is that of each of its arrow files, in order."""
    if url == BUILTIN_CORPUS:
        return data_identity(None)
    files = _columnar_files(url, storage_options)
    with _input_errors(url):
        if files is None or files == [url]:
            return file_identity(url, storage_options)
        return {"url": url, "files": [file_identity(file, storage_options) for file in files]}


@contextlib.contextmanager
def _input_errors(url: str) -> Iterator[None]:
    """A missing or unopenable input as a UserError naming it."""
    try:
        yield
    except FileNotFoundError:
        raise UserError(f"input {url} does not exist; check the path or URL") from None
    except (ValueError, ImportError, IsADirectoryError) as e:
        raise UserError(f"input {url} cannot be opened ({e}); pass a text, JSON-lines or parquet file, a "
                        f"save_to_disk folder, or an fsspec URL of one") from None


@contextlib.contextmanager
def _open_binary(url: str, storage_options: dict | None) -> Iterator[BinaryIO]:
    """The input's bytes, decompressed when its name ends in .gz or .zst."""
    with _input_errors(url):
        fs, path = open_filesystem(url, storage_options)
        raw = fs.open(path, "rb")
    stream = raw
    if url.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
    elif url.endswith(".zst"):
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    try:
        yield io.BufferedReader(stream) if stream is raw else stream
    finally:
        stream.close()
        raw.close()


def _undecodable_position(url: str, storage_options: dict | None) -> tuple[int, int]:
    """(line, byte offset in the decompressed input) of the first byte sequence of `url` that is
    not UTF-8; a character cut off by the end of the input is at its first byte."""
    line = offset = 0  # newlines before, and the offset of, the first byte not yet decoded
    pending = b""
    with _open_binary(url, storage_options) as stream:
        while chunk := stream.read(_CHUNK):
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", False)
            except UnicodeDecodeError as e:
                return line + data.count(b"\n", 0, e.start) + 1, offset + e.start
            line += data.count(b"\n", 0, used)
            offset += used
            pending = data[used:]
    return line + 1, offset


def _checked_lines(url: str, lines: io.TextIOBase) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text; binary or damaged compressed input is a UserError."""
    number = 0
    try:
        for number, line in enumerate(lines, start=1):
            if "\x00" in line:
                raise UserError(f"input {url} line {number} holds NUL bytes: it is binary, not text; "
                                f"pass text or JSON lines (.gz/.zst compressed is fine)")
            yield number, line
    except (OSError, EOFError) as e:  # a corrupt .gz / .zst stream
        raise UserError(f"input {url} cannot be decompressed after line {number} ({e}); the file is damaged") from None


def _json_documents(url: str, lines: io.TextIOBase, field: str) -> Iterator[str]:
    for number, line in _checked_lines(url, lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"input {url} line {number} is not JSON ({e.msg}); JSON-lines inputs hold one "
                            f"object per line") from None
        if not isinstance(record, dict) or field not in record:
            raise UserError(f"input {url} line {number} has no field {field!r}; pass --text-field with the name of "
                            f"the text field")
        text = record[field]
        if not isinstance(text, str):
            raise UserError(f"input {url} line {number}: field {field!r} is a {type(text).__name__}, not text")
        if text:
            yield text
