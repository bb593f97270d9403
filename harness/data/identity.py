"""The identity of the training data, recorded with every checkpoint so a resume can refuse other data.

`data_identity(url, storage_options)` is `{"url": ..., "size": ..., "head": ..., "tail": ...}`
for today's one source type, a text file (or the built-in corpus, `url` None): its size in bytes
and the sha256 of its first and last `BLOCK` bytes. Cheap on purpose: two ranged reads, however
large the file, so it is taken at every start. It catches another file, a file replaced, grown,
truncated or re-exported; an edit in the middle that keeps the size is not caught.

A new source type (token shards: the hash of `index.json`, which lists every shard's sha256)
returns its own fingerprint from its own function here, and `data_identity` dispatches to it by
URL. The run compares the whole dict (`harness.run.resume.check_compatible`): any difference is a change
of the run's math, refused like a changed config key.
"""

from __future__ import annotations

import hashlib
from typing import Any

from harness.data.corpus import default_corpus
from harness.data.dataset import data_errors
from harness.storage.filesystem import open_filesystem

BLOCK = 1 << 20


def data_identity(url: str | None, storage_options: dict | None = None) -> dict[str, Any]:
    """The identity of the data at `url` (None: the built-in corpus); see the module docstring.
    Raises UserError when it cannot be read (the same message as loading it)."""
    if url is None:
        data = default_corpus()
        return {"url": None, **_fingerprint(len(data), data[:BLOCK], data[-BLOCK:])}
    with data_errors(url):
        return file_identity(url, storage_options)


def file_identity(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """`data_identity` of the file at `url`, its errors (FileNotFoundError, ...) raised as they
    come, for a caller that words them for its own setting (`harness data prepare`'s inputs)."""
    fs, path = open_filesystem(url, storage_options)
    size = fs.size(path)
    head = fs.cat_file(path, start=0, end=min(BLOCK, size))
    tail = fs.cat_file(path, start=max(0, size - BLOCK), end=size)
    return {"url": url, **_fingerprint(size, head, tail)}


def _fingerprint(size: int, head: bytes, tail: bytes) -> dict[str, Any]:
    return {"size": size, "head": hashlib.sha256(head).hexdigest(), "tail": hashlib.sha256(tail).hexdigest()}
