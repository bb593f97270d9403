"""`prepare`: documents -> tokens -> fixed-size shards + `index.json`, restartable anywhere.

The token stream is a pure function of the inputs and the tokenizer (documents.py gives them in
a fixed order; a document's ids do not depend on which worker encoded it), so the shards, cut
every `shard_tokens` tokens, are too. That is what makes a restart cheap and exact:

- After each shard is durable (local disk: written to a temporary name, fsynced, renamed, the
  folder fsynced; object stores: one PUT), `.prepare-state.json` records it with the stream
  position where the next shard starts: (document number, tokens of that document already used),
  and each input's identity (size, sha256 of its first and last MiB: `documents.input_identity`).
- A restart with the same arguments and unchanged inputs keeps the recorded shards, skips the
  documents before that position without tokenizing them, drops the used tokens of the document
  it lands in, and goes on. A shard written but not yet recorded is simply written again, with
  the same bytes.
- A restart with the same arguments whose inputs changed (another size or first/last MiB) starts
  again from the beginning, with a warning naming the input: the recorded shards hold text that
  is no longer there and the stream positions point into other text, and an unfinished folder
  has no index, so nothing can have used them. (Other arguments are refused instead: that is
  more likely a wrong --out than a new mind, and it would discard another prepare's work.)
- `index.json` is written after every shard, then the state file is removed. A folder with an
  index and no state file is finished; one with neither is started again from the beginning.

So a prepare killed at any point and started again produces byte-identical output. The
tokenizer is `tokenizer.json` in the output (trained first for `train-bpe:VOCAB`; training is
deterministic, so a retrain after a kill gives the same file), written with the first shard: a
prepare of inputs that hold no text writes nothing and is an error.

The index counts documents by their end-of-document ids, so a document whose text encodes to
that id (the separator written out in the text, or a tokenizer that emits it for text) is an
error, and the unfinished output is removed (it could never finish with these arguments).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from harness.data import tokenize_worker
from harness.data.documents import TextSplit, check_inputs, input_identity, iter_documents
from harness.data.shard_index import INDEX_NAME, TOKENIZER_NAME, ShardEntry, ShardIndex, dtype_for, shard_name
from harness.data.tokenizers_spec import EOD_TOKEN, TokenizerInfo, is_trained, resolve_tokenizer
from harness.errors import UserError
from harness.log import get_logger
from harness.storage.location import Location, fsync_dir, open_location, rename, write_stream

log = get_logger(__name__)

STATE_NAME = ".prepare-state.json"
_DOCS_PER_TASK = 256


@dataclass(frozen=True)
class PrepareSpec:
    """Everything that decides the output bytes; a restart must be given the same."""

    inputs: tuple[str, ...]
    tokenizer: str
    field: str = "text"
    text_split: TextSplit = "file"
    eod: str = EOD_TOKEN
    shard_tokens: int = 1 << 24

    def __post_init__(self) -> None:
        if self.shard_tokens < 1:
            raise UserError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if not self.inputs:
            raise UserError("no INPUT given: pass one or more text, JSON-lines or parquet files or save_to_disk "
                            "folders")


@dataclass
class _Progress:
    """The shards done and where the next one starts in the document stream."""

    shards: list[ShardEntry] = field(default_factory=list)
    next_document: int = 0
    next_token: int = 0


def prepare(spec: PrepareSpec, out: str, *, workers: int = 0, storage_options: dict | None = None) -> ShardIndex:
    """Write the dataset for `spec` at `out` (resuming an interrupted prepare there); returns its
    index. Raises UserError for bad inputs, a finished dataset at `out`, or an unfinished one
    made with other arguments."""
    check_inputs(list(spec.inputs), field=spec.field, storage_options=storage_options)
    loc = open_location(out, storage_options)
    loc.fs.makedirs(loc.root, exist_ok=True)
    progress, tokenizer, header = _resume_or_start(spec, loc, storage_options)
    dtype = dtype_for(tokenizer.vocab_size)
    started = time.perf_counter()
    bar = tqdm(desc="prepare", unit="tok", unit_scale=True, disable=not sys.stderr.isatty(), dynamic_ncols=True,
               initial=sum(s.tokens for s in progress.shards))
    buffer = np.empty(spec.shard_tokens, dtype=dtype)
    filled = documents_in_buffer = 0
    doc_number, skip = progress.next_document, progress.next_token
    try:
        for tokens in _encoded(spec, tokenizer, dtype, progress.next_document, workers, storage_options):
            if (tokens[:-1] == tokenizer.eod_id).any():
                _discard(loc, progress)  # never to be finished: kept, it would refuse a run with another --eod
                raise UserError(_separator_in_text(tokenizer, doc_number))
            # Resuming inside a document: its first `skip` tokens are in the shards already.
            used, skip = skip, 0
            while used < len(tokens):
                take = min(spec.shard_tokens - filled, len(tokens) - used)
                buffer[filled:filled + take] = tokens[used:used + take]
                filled += take
                used += take
                if used == len(tokens):
                    documents_in_buffer += 1
                if filled == spec.shard_tokens:
                    # The next shard starts `used` tokens into this document, or at the next one.
                    at = (doc_number + 1, 0) if used == len(tokens) else (doc_number, used)
                    _write_shard(loc, progress, buffer, documents_in_buffer, at, header, tokenizer)
                    bar.update(filled)
                    filled = documents_in_buffer = 0
            doc_number += 1
        if filled:
            _write_shard(loc, progress, buffer[:filled], documents_in_buffer, (doc_number, 0), header, tokenizer)
            bar.update(filled)
    finally:
        bar.close()
    if not progress.shards:
        raise UserError(f"the inputs hold no text ({', '.join(spec.inputs)}): a dataset needs at least one "
                        f"document; pass inputs with text")
    index = ShardIndex(tokenizer={"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                                  "specials": tokenizer.specials, "eod_id": tokenizer.eod_id,
                                  "eod_token": tokenizer.eod_token},
                       dtype=dtype, shards=tuple(progress.shards))
    _publish(loc, INDEX_NAME, index.to_json())
    loc.fs.rm(loc.join(STATE_NAME))
    seconds = time.perf_counter() - started
    log.info("prepared", out=out, shards=len(index.shards), tokens=index.total_tokens,
             documents=index.total_documents, dtype=dtype, vocab=tokenizer.vocab_size,
             tokens_per_s=round(index.total_tokens / seconds) if seconds else None)
    return index


def _resume_or_start(spec: PrepareSpec, loc: Location,
                     storage_options: dict | None) -> tuple[_Progress, TokenizerInfo, dict]:
    """(progress, tokenizer, the state file's header: arguments and input identities)."""
    state_path, tokenizer_path = loc.join(STATE_NAME), loc.join(TOKENIZER_NAME)
    header: dict[str, Any] = {"spec": _spec_doc(spec),
                              "inputs": [input_identity(url, storage_options) for url in spec.inputs]}
    if loc.fs.exists(state_path):
        state = json.loads(loc.fs.cat_file(state_path))
        if state["spec"] != header["spec"]:
            raise UserError(f"{loc.url} holds an unfinished prepare with other arguments ({state['spec']}); run it "
                            f"again with those, or choose another --out")
        progress = _Progress([ShardEntry(**s) for s in state["shards"]], *state["next"])
        changed = _changed_input(state.get("inputs"), header["inputs"], spec.inputs)
        if changed is None:
            tokenizer = TokenizerInfo.from_json(loc.fs.cat_file(tokenizer_path).decode(), spec.eod,
                                                loc.url_of(tokenizer_path))
            log.info("resuming prepare", out=loc.url, shards_done=len(progress.shards))
            return progress, tokenizer, header
        log.warning("an input changed since this prepare started; its shards are discarded and it starts again "
                    "from the beginning", out=loc.url, input=changed, shards_discarded=len(progress.shards))
        _discard(loc, progress)
    elif loc.fs.exists(loc.join(INDEX_NAME)):
        raise UserError(f"{loc.url} already holds a prepared dataset ({INDEX_NAME}); choose another --out, or "
                        f"delete it to prepare again")
    training_text = iter_documents(list(spec.inputs), field=spec.field, text_split=spec.text_split,
                                   storage_options=storage_options) if is_trained(spec.tokenizer) else None
    return _Progress(), resolve_tokenizer(spec.tokenizer, training_text, spec.eod, storage_options), header


def _separator_in_text(tokenizer: TokenizerInfo, doc_number: int) -> str:
    """The index counts documents by their EOD ids, so an EOD id inside a document's text would
    make it count documents that are not there."""
    return (f"the tokenizer encodes text of document {doc_number + 1} (counted over the inputs in order) as the "
            f"end-of-document id {tokenizer.eod_id} ({tokenizer.eod_token!r}): the text holds {tokenizer.eod_token!r} "
            f"literally, or the tokenizer emits it for text; remove it from the text, or pass --eod with a special "
            f"token that text never gives")


def _changed_input(recorded: list[dict] | None, current: list[dict], inputs: tuple[str, ...]) -> str | None:
    """The first input whose identity differs from the one recorded, or None when all match.
    A state file without identities (written by an older harness) cannot be trusted: the first input."""
    if recorded is None or len(recorded) != len(current):
        return inputs[0]
    return next((url for url, then, now in zip(inputs, recorded, current, strict=True) if then != now), None)


def _discard(loc: Location, progress: _Progress) -> None:
    """Remove an unfinished prepare's files, the state file last: killed on the way, the next
    run finds the state, sees the same change and discards again."""
    for name in [s.name for s in progress.shards] + [TOKENIZER_NAME, STATE_NAME]:
        if loc.fs.exists(loc.join(name)):
            loc.fs.rm(loc.join(name))


def _encoded(spec: PrepareSpec, tokenizer: TokenizerInfo, dtype: str, first_document: int, workers: int,
             storage_options: dict | None) -> Iterator[np.ndarray]:
    """Each document's tokens (EOD last) from document `first_document` on, in order; the
    documents before it are read but not tokenized."""
    documents = iter_documents(list(spec.inputs), field=spec.field, text_split=spec.text_split,
                               storage_options=storage_options)
    for _ in range(first_document):
        if next(documents, None) is None:
            break
    tasks = _batched(documents, _DOCS_PER_TASK)
    if workers == 0:
        tokenize_worker.start(tokenizer.json, tokenizer.eod_id, dtype, in_worker=False)
        for task in tasks:
            yield from tokenize_worker.encode(task)
        return
    # spawn: a forked child of a process whose tokenizer used its thread pool (training) may deadlock.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, tokenize_worker.start, (tokenizer.json, tokenizer.eod_id, dtype)) as pool:
        # Not pool.imap: its feeder thread would read every input into memory ahead of the workers.
        in_flight: deque = deque()
        for task in tasks:
            in_flight.append(pool.apply_async(tokenize_worker.encode, (task,)))
            if len(in_flight) >= 2 * workers:
                yield from in_flight.popleft().get()
        while in_flight:
            yield from in_flight.popleft().get()


def _batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_shard(loc: Location, progress: _Progress, tokens: np.ndarray, documents: int, next_at: tuple[int, int],
                 header: dict, tokenizer: TokenizerInfo) -> None:
    """Publish the next shard (the tokenizer first, with the first shard), then record it."""
    if not progress.shards:
        _publish(loc, TOKENIZER_NAME, tokenizer.json.encode())
    name = shard_name(len(progress.shards))
    data = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
    sha256 = _publish(loc, name, data)
    progress.shards.append(ShardEntry(name, len(tokens), documents, sha256))
    progress.next_document, progress.next_token = next_at
    state = {**header, "shards": [asdict(s) for s in progress.shards],
             "next": [progress.next_document, progress.next_token]}
    _publish(loc, STATE_NAME, json.dumps(state, indent=1).encode())


def _spec_doc(spec: PrepareSpec) -> dict:
    return json.loads(json.dumps(asdict(spec)))  # tuples as lists, as the state file reads back


def _publish(loc: Location, name: str, data: bytes) -> str:
    """Write `name` whole or not at all; returns its sha256. Local disk: a temporary name,
    fsync, rename, folder fsync. Object stores: one PUT is atomic already."""
    final = loc.join(name)
    if not loc.is_local:
        return write_stream(loc, final, [data])[1]
    temporary = loc.join(f".{name}.tmp")
    _, sha256 = write_stream(loc, temporary, [data])
    rename(loc, temporary, final)
    fsync_dir(loc, loc.root)
    return sha256
