"""Tokenizers for `harness data prepare`, named by a SPEC string, all from HF `tokenizers`.

SPEC is one of:
- `bytes`: byte-level, id = byte value (0..255), the end-of-document token (`<|endoftext|>`) = 256.
  The same ids the byte-text source trains on, plus the separator.
- `train-bpe:VOCAB`: a byte-level BPE of at most VOCAB ids trained on the input documents
  themselves (offline, deterministic: the same input gives the same tokenizer.json bytes). A
  text too small for VOCAB gives fewer, with a warning naming both; no text at all is an error.
- a path or fsspec URL of a `tokenizer.json`.

Every tokenizer is used through its JSON text: workers rebuild it from that string, and its
sha256 is the tokenizer hash written to the index.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harness.errors import UserError
from harness.log import get_logger
from harness.storage.filesystem import open_filesystem

log = get_logger(__name__)

EOD_TOKEN = "<|endoftext|>"
_TRAIN_BPE = "train-bpe:"


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer as the index records it: its JSON text, that text's sha256, the number of
    ids (specials included), its special tokens (token -> id) and the end-of-document id."""

    json: str
    sha256: str
    vocab_size: int
    specials: dict[str, int]
    eod_id: int
    eod_token: str

    @classmethod
    def from_json(cls, text: str, eod_token: str, origin: str) -> TokenizerInfo:
        """Raises UserError when `text` is no tokenizer or lacks `eod_token`."""
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception for malformed JSON
            raise UserError(f"tokenizer {origin} is not a tokenizers JSON file ({e}); pass a tokenizer.json, "
                            f"`bytes` or `train-bpe:VOCAB`") from None
        specials = {token.content: i for i, token in sorted(tokenizer.get_added_tokens_decoder().items())}
        unknown = _unknown_token(text)
        if eod_token == unknown:
            raise UserError(f"tokenizer {origin}: {eod_token!r} is its unknown-word token, which it also emits for "
                            f"text, so it cannot end documents; {_separator_advice(specials, unknown)}")
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise UserError(f"tokenizer {origin} has no token {eod_token!r} to end documents with; "
                            f"{_separator_advice(specials, unknown)}")
        return cls(text, hashlib.sha256(text.encode()).hexdigest(), tokenizer.get_vocab_size(), specials, eod,
                   eod_token)

    def build(self) -> Tokenizer:
        return Tokenizer.from_str(self.json)


def _unknown_token(text: str) -> str | None:
    """The token a tokenizer.json's model emits for what its vocabulary lacks, if it has one."""
    model = json.loads(text).get("model") or {}
    if model.get("unk_token") is not None:  # BPE, WordPiece, WordLevel
        return str(model["unk_token"])
    if model.get("unk_id") is not None:  # Unigram: vocab is [[piece, score], ...]
        return str(model["vocab"][model["unk_id"]][0])
    return None


def _separator_advice(specials: dict[str, int], unknown: str | None) -> str:
    candidates = [token for token in specials if token != unknown]
    if candidates:
        return f"pass --eod with one of its other special tokens ({', '.join(candidates)})"
    return f"it has no other special token: add one that only ends documents (e.g. {EOD_TOKEN}) to its added_tokens"


def is_trained(spec: str) -> bool:
    """Whether SPEC trains its tokenizer on the input (prepare must read the input twice)."""
    return spec.startswith(_TRAIN_BPE)


def resolve_tokenizer(spec: str, documents: Iterable[str] | None = None, eod_token: str = EOD_TOKEN,
                      storage_options: dict | None = None) -> TokenizerInfo:
    """The tokenizer SPEC names; `documents` is the training text for `train-bpe:VOCAB`.
    Raises UserError for a bad SPEC, a missing file or a missing end-of-document token."""
    if spec == "bytes":
        return TokenizerInfo.from_json(byte_tokenizer(eod_token).to_str(), eod_token, "bytes")
    if spec.startswith(_TRAIN_BPE):
        text = spec[len(_TRAIN_BPE):]
        if not text.isdigit() or not 257 <= int(text) <= 1 << 24:
            raise UserError(f"--tokenizer {spec}: VOCAB must be an integer in [257, 16777216] "
                            f"(256 bytes + the end-of-document token at least), e.g. train-bpe:8192")
        trained = TokenizerInfo.from_json(train_bpe(documents or (), int(text), eod_token).to_str(), eod_token, spec)
        if trained.vocab_size < int(text):
            # Training stops when no pair of tokens is left to merge: the text is too small or too plain.
            log.warning("the trained tokenizer's vocabulary is smaller than asked: the text has no more pairs to "
                        "merge", asked=int(text), got=trained.vocab_size)
        return trained
    try:
        fs, path = open_filesystem(spec, storage_options)
        text = fs.cat_file(path).decode("utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise UserError(f"--tokenizer {spec}: no such file; pass a tokenizer.json path or URL, "
                        f"`bytes` or `train-bpe:VOCAB`") from None
    except (ValueError, ImportError, UnicodeDecodeError) as e:
        raise UserError(f"--tokenizer {spec}: cannot be read ({e}); pass a tokenizer.json path or URL") from None
    return TokenizerInfo.from_json(text, eod_token, spec)


def byte_tokenizer(eod_token: str = EOD_TOKEN) -> Tokenizer:
    """Byte-level: every byte is its own id, `eod_token` is 256. Built as a BPE without
    merges over the ByteLevel alphabet, so it round-trips any UTF-8 text."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([eod_token])
    return tokenizer


def train_bpe(documents: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN) -> Tokenizer:
    """A byte-level BPE trained on `documents` with `eod_token` as its one special token (the
    HF trainer is deterministic for equal input)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = _nonempty(documents)
    first = next(texts, None)
    if first is None:
        raise UserError(f"--tokenizer train-bpe:{vocab_size}: the inputs hold no text to train it on; pass inputs "
                        f"with text")
    tokenizer.train_from_iterator(itertools.chain([first], texts), trainer)
    return tokenizer


def _nonempty(documents: Iterable[str]) -> Iterator[str]:
    return (d for d in documents if d)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel steps use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
