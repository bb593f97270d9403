"""Hold out the last documents of a token-shard dataset for evaluation.

The split is by document, not by window: the eval set starts at the first window after the end
of document `D - ceil(eval_fraction * D)` (D = the index's document count), so no eval window
holds a token of a training document and no training window a token of an eval one (the window
across the boundary is dropped). Finding that boundary reads one shard's worth of tokens at most,
in chunks, at start-up; the per-shard document counts in the index say which shard.
"""

from __future__ import annotations

import math

import numpy as np

from harness.data.dataset import TokenDataset
from harness.data.shard_reader import ShardReader
from harness.errors import UserError

_SCAN_TOKENS = 1 << 20


def split_by_document(reader: ShardReader, seq_len: int, eval_fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """(train, eval) windows of `seq_len + 1` tokens on either side of the document boundary."""
    index = reader.index
    documents = index.total_documents
    held_out = math.ceil(eval_fraction * documents)
    if not 0.0 < eval_fraction < 1.0 or held_out >= documents:
        raise UserError(f"eval_fraction {eval_fraction} of the {documents} documents of {reader.url} leaves no "
                        f"training or no eval documents: use a value in (0, 1) and a dataset of more documents")
    boundary = _end_of_document(reader, documents - held_out)
    windows = (len(reader) - 1) // seq_len
    train_windows = (boundary - 1) // seq_len
    first_eval = -(-boundary // seq_len)
    if train_windows < 1 or first_eval >= windows:
        raise UserError(f"{reader.url}: the document split at token {boundary} leaves no whole window of "
                        f"seq_len + 1 = {seq_len + 1} on one side; lower seq_len or change eval_fraction")
    return (TokenDataset(reader, seq_len, 0, train_windows),
            TokenDataset(reader, seq_len, first_eval, windows - first_eval))


def _end_of_document(reader: ShardReader, number: int) -> int:
    """The token position just after the EOD that ends document `number` (1-based)."""
    eod = int(reader.index.tokenizer["eod_id"])
    before = 0
    for shard, entry in enumerate(reader.index.shards):
        if before + entry.documents >= number:
            break
        before += entry.documents
    start, stop = reader.offsets[shard], reader.offsets[shard + 1]
    for chunk_start in range(start, stop, _SCAN_TOKENS):
        length = min(_SCAN_TOKENS, stop - chunk_start)
        ends = np.flatnonzero(reader.read_windows([chunk_start], length)[0] == eod)
        if before + len(ends) >= number:
            return chunk_start + int(ends[number - before - 1]) + 1
        before += len(ends)
    raise UserError(f"{reader.url}: shard {reader.index.shards[shard].name} holds fewer end-of-document tokens "
                    f"than its index says; prepare the dataset again")
