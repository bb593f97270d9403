"""Columnar inputs of `harness data prepare`: parquet files and `datasets` folders, as documents.

- `NAME.parquet`: a parquet file (what HF datasets and FineWeb-style corpora ship, and what
  `load_dataset("parquet", data_files=...)` reads); only the text column is read, `_ROWS` rows at a
  time, one row group after another.
- `NAME.arrow`: an Arrow IPC stream, the file format the `datasets` library writes
  (`Dataset.save_to_disk`, its cache), read one record batch at a time.
- a folder saved by `Dataset.save_to_disk`: its `state.json` lists its arrow files in order
  (`_data_files`); its documents are theirs in that order (save_to_disk writes a shuffled or
  selected dataset in its indexed order, so that is the dataset's row order). A `DatasetDict`
  folder (`dataset_dict.json`) is refused, naming a split folder to pass instead.

So memory holds one row group's text column chunk and a record batch of it (parquet) or one record
batch (arrow), whatever the size of the file (ops/bench/prepare_rss.py: peak RSS flat). A row's
value in the text column is one document, as a JSON line's field is (documents.py): an empty string
is no document, a null is an error naming the file and row. The column must hold strings; that and
its presence are checked in every file (`check_text_column`) before prepare writes anything.
pyarrow is the `parquet` extra, imported only when such an input is given.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from harness.errors import UserError
from harness.storage.filesystem import open_filesystem

PARQUET_SUFFIX = ".parquet"
ARROW_SUFFIX = ".arrow"
STATE_FILE = "state.json"
DATASET_DICT_FILE = "dataset_dict.json"
_ROWS = 1024


def data_files(url: str, storage_options: dict | None = None) -> list[str] | None:
    """The files holding a columnar input's rows, in order: `[url]` for a parquet or arrow file,
    the arrow files of a save_to_disk folder; None for an input that is not columnar. A folder
    that is not a saved dataset, or whose arrow files are not all there, is a UserError."""
    if url.endswith((PARQUET_SUFFIX, ARROW_SUFFIX)):
        return [url]
    fs, path = open_filesystem(url, storage_options)
    if not fs.isdir(path):
        return None
    folder = url.rstrip("/")
    if fs.exists(f"{path}/{DATASET_DICT_FILE}"):
        splits = _json_of(fs, f"{path}/{DATASET_DICT_FILE}", url).get("splits") or ["SPLIT"]
        raise UserError(f"input {url} is a DatasetDict (splits: {', '.join(map(str, splits))}); pass one split's "
                        f"folder, e.g. {folder}/{splits[0]}")
    if not fs.exists(f"{path}/{STATE_FILE}"):
        raise UserError(f"input {url} is a folder without {STATE_FILE}: not a dataset saved with save_to_disk; pass "
                        f"such a folder, or the parquet, arrow, JSON-lines or text files themselves")
    listed = _json_of(fs, f"{path}/{STATE_FILE}", url).get("_data_files")
    names = [entry.get("filename") for entry in listed or [] if isinstance(entry, dict)]
    if not names or not all(isinstance(name, str) for name in names):
        raise UserError(f"input {url}: its {STATE_FILE} lists no arrow files (_data_files); save the dataset again "
                        f"with save_to_disk")
    if missing := [name for name in names if not fs.exists(f"{path}/{name}")]:
        raise UserError(f"input {url}: {missing[0]}, listed in its {STATE_FILE}, is missing ({len(missing)} of "
                        f"{len(names)} arrow files are); restore the files or save the dataset again")
    return [f"{folder}/{name}" for name in names]


def check_text_column(files: list[str], field: str, storage_options: dict | None = None) -> None:
    """Raise a UserError naming the file unless each file is readable and has a string column
    `field`. Reads each file's schema only (a parquet footer, an arrow stream's first message)."""
    for file in files:
        with _opened(file, storage_options) as (schema, _):
            _check_text_column(file, schema, field)


def documents(files: list[str], field: str, storage_options: dict | None = None) -> Iterator[str]:
    """The non-empty values of column `field` of every row of `files`, in order, one record
    batch in memory at a time."""
    for file in files:
        with _opened(file, storage_options) as (schema, batches):
            _check_text_column(file, schema, field)
            row = 0
            for batch in batches(field):
                for value in batch.column(field).to_pylist():
                    row += 1
                    if value is None:
                        raise UserError(f"input {file} row {row}: column {field!r} is null, not text; drop those "
                                        f"rows or fill them with text")
                    if value:
                        yield value


@contextlib.contextmanager
def _opened(file: str, storage_options: dict | None) -> Iterator[tuple[Any, Any]]:
    """(the file's arrow schema, batches(column) -> its record batches, holding that column);
    pyarrow's errors while it is open (a damaged file, another format) as a UserError naming it."""
    pa, pq = _pyarrow()
    parquet = file.endswith(PARQUET_SUFFIX)
    fs, path = open_filesystem(file, storage_options)
    with fs.open(path, "rb") as stream:
        try:
            if parquet:
                reader = pq.ParquetFile(stream)
                yield reader.schema_arrow, lambda column: _row_group_batches(reader, column)
            else:
                reader = pa.ipc.open_stream(stream)
                yield reader.schema, lambda column: reader  # a stream's batches hold every column
        except (pa.ArrowException, OSError) as e:  # pyarrow reports a damaged page as a plain OSError
            reason = " ".join("".join(c if c.isprintable() else " " for c in str(e)).split())
            raise UserError(f"input {file} is not a readable {'parquet' if parquet else 'Arrow IPC stream'} file "
                            f"({reason}); the file is damaged or in another format: download or export it "
                            f"again") from None


def _row_group_batches(reader: Any, column: str) -> Iterator[Any]:
    """One batch reader per row group: one over all of them (pyarrow 26) held on to memory for
    each row group it had read, peak RSS growing with the file (ops/bench/prepare_rss.py)."""
    for group in range(reader.num_row_groups):
        yield from reader.iter_batches(batch_size=_ROWS, columns=[column], row_groups=[group])


def _check_text_column(file: str, schema: Any, field: str) -> None:
    pa, _ = _pyarrow()
    if field not in schema.names:
        raise UserError(f"input {file} has no column {field!r} (its columns: {', '.join(schema.names)}); pass "
                        f"--text-field with the one holding the text")
    kind = schema.field(field).type
    if not _is_string(pa, kind):
        strings = [f.name for f in schema if _is_string(pa, f.type)]
        raise UserError(f"input {file}: column {field!r} holds {kind}, not strings; pass --text-field with the column "
                        f"holding the text (its string columns: {', '.join(strings) or 'none'})")


def _is_string(pa: Any, kind: Any) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _json_of(fs: Any, path: str, url: str) -> dict:
    try:
        document = json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"input {url}: {path.rsplit('/', 1)[-1]} is not JSON ({e}); save the dataset again with "
                        f"save_to_disk") from None
    if not isinstance(document, dict):
        raise UserError(f"input {url}: {path.rsplit('/', 1)[-1]} is not a JSON object; save the dataset again with "
                        f"save_to_disk")
    return document


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError("parquet and arrow inputs need pyarrow: pip install -e '.[parquet]' (or pip install "
                        "pyarrow)") from None
    return pyarrow, pyarrow.parquet
