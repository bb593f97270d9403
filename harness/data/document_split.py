"""Hold out the end of a token-shard dataset for evaluation: `eval_fraction` of its windows,
cut at a document end when one is near.

The eval set is the last `ceil(eval_fraction * W)` of the dataset's W windows (as for a text
file, `TokenDataset.split`), and the cut moves to the nearest document end within a tenth of the
eval set's tokens (at most `_SCAN_TOKENS` either way): then no eval window holds a token of a
training document nor a training window a token of an eval one (the window across the end is
dropped), and the eval set is still about `eval_fraction` of the data. With no document end that
near (a few long documents: `--text-split file` makes each input file one), the cut is inside a
document, at the window boundary: the eval set is that document's tail, never most of the data.

Finding the cut reads at most `2 * _SCAN_TOKENS` tokens around it, once, at start-up.
"""

from __future__ import annotations

import math

import numpy as np

from harness.data.dataset import TokenDataset
from harness.data.shard_reader import ShardReader
from harness.errors import UserError

_SCAN_TOKENS = 1 << 20
_NEAR = 0.1  # of the eval set's tokens: how far the cut may move to a document end


def split_by_document(reader: ShardReader, seq_len: int, eval_fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """(train, eval) windows of `seq_len + 1` tokens on either side of the cut (module docstring)."""
    windows = (len(reader) - 1) // seq_len
    held_out = math.ceil(eval_fraction * windows)
    if not 0.0 < eval_fraction < 1.0 or windows - held_out < 1:
        raise UserError(f"eval_fraction {eval_fraction} of the {windows} windows of seq_len + 1 = {seq_len + 1} "
                        f"tokens of {reader.url} leaves no training or no eval windows: use a value in (0, 1), a "
                        f"smaller seq_len or a larger dataset")
    cut = (windows - held_out) * seq_len
    reach = min(held_out * seq_len * _NEAR, _SCAN_TOKENS)
    end = _nearest_document_end(reader, cut, int(reach), windows, seq_len)
    if end is None:
        return (TokenDataset(reader, seq_len, 0, windows - held_out),
                TokenDataset(reader, seq_len, windows - held_out, held_out))
    train_windows, first_eval = (end - 1) // seq_len, -(-end // seq_len)
    return (TokenDataset(reader, seq_len, 0, train_windows),
            TokenDataset(reader, seq_len, first_eval, windows - first_eval))


def _nearest_document_end(reader: ShardReader, cut: int, reach: int, windows: int, seq_len: int) -> int | None:
    """The token position just after the EOD nearest to `cut` within `reach` tokens of it, such
    that a whole window is left on either side; None when there is none."""
    eod = int(reader.index.tokenizer["eod_id"])
    start, stop = max(0, cut - reach - 1), min(len(reader), cut + reach)
    ends = start + np.flatnonzero(reader.read_windows([start], stop - start)[0] == eod) + 1
    ends = ends[((ends - 1) // seq_len >= 1) & (-(-ends // seq_len) < windows)]
    if not len(ends):
        return None
    return int(ends[np.argmin(np.abs(ends - cut))])
