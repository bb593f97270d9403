"""Tokenizing batches of documents, in the prepare process or in its worker processes.

Kept apart from prepare.py so a worker process imports only this and the tokenizer: each worker
rebuilds the tokenizer from its JSON text once (`start`), then turns document batches into
token arrays (`encode`), each document followed by the end-of-document id.
"""

from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

_tokenizer: Tokenizer | None = None
_eod: int = 0
_dtype: str = "uint32"


def start(tokenizer_json: str, eod_id: int, dtype: str, in_worker: bool = True) -> None:
    """Set this process's tokenizer. In a worker process the tokenizer's own thread pool is
    turned off: the processes already use every core, and threads on top would oversubscribe."""
    global _tokenizer, _eod, _dtype
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tokenizer = Tokenizer.from_str(tokenizer_json)
    _eod, _dtype = eod_id, dtype


def encode(documents: list[str]) -> list[np.ndarray]:
    """One array per document: its ids then the end-of-document id, in the shard dtype."""
    assert _tokenizer is not None, "start() first"
    out = []
    for encoding in _tokenizer.encode_batch(documents, add_special_tokens=False):
        ids = np.empty(len(encoding.ids) + 1, dtype=_dtype)
        ids[:-1] = encoding.ids
        ids[-1] = _eod
        out.append(ids)
    return out
