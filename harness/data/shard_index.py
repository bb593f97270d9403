"""`index.json` of a token-shard dataset: what the shards hold, written last by prepare.

Layout of a dataset folder (any fsspec URL):
```
shard-000000.bin ...  flat little-endian token ids (`dtype`), documents ended by the EOD id
tokenizer.json        the tokenizer the ids come from (its sha256 is `tokenizer.sha256`)
index.json            format, tokenizer {sha256, vocab_size, specials, eod_id}, dtype,
                      shards [{name, tokens, documents, sha256}], totals
```
The index is serialised deterministically (sorted keys, no timestamps), so equal datasets have
byte-equal indexes and the index's sha256 identifies the dataset: it is what checkpoints record.
A shard's `documents` counts the EOD tokens in it (documents may span shards).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.location import Location, open_location, read_bytes
from harness.errors import UserError

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
TOKENIZER_NAME = "tokenizer.json"
_INDEX_LIMIT = 256 << 20
DTYPES = {"uint16": 2, "uint32": 4}


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.bin"


def dtype_for(vocab_size: int) -> str:
    """uint16 when every id fits in it, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class ShardEntry:
    name: str
    tokens: int
    documents: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    tokenizer: dict[str, Any]  # sha256, vocab_size, specials, eod_id, eod_token
    dtype: str
    shards: tuple[ShardEntry, ...]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def total_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT_VERSION, "tokenizer": self.tokenizer, "dtype": self.dtype,
               "shards": [vars(s) for s in self.shards],
               "totals": {"shards": len(self.shards), "tokens": self.total_tokens,
                          "documents": self.total_documents}}
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    @property
    def sha256(self) -> str:
        """The dataset's identity: the hash of its index bytes (shard hashes included)."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ShardIndex:
        """Parse and check an index; anything malformed is a UserError naming `where`."""
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {doc.get('format')!r}, this harness reads format {FORMAT_VERSION}")
            if doc["dtype"] not in DTYPES:
                raise ValueError(f"dtype {doc['dtype']!r} is not one of {sorted(DTYPES)}")
            shards = tuple(ShardEntry(str(s["name"]), int(s["tokens"]), int(s["documents"]), str(s["sha256"]))
                           for s in doc["shards"])
            index = cls(dict(doc["tokenizer"]), doc["dtype"], shards)
            index.vocab_size  # noqa: B018 - must be present and an integer
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where} is not a token-shard index ({e}); run `harness data prepare` to make one") from None
        if not shards or any(s.tokens < 1 or "/" in s.name for s in shards):
            raise UserError(f"{where} lists no shards or an empty/odd shard; prepare the dataset again")
        return index


def read_index(url: str, storage_options: dict | None = None) -> tuple[ShardIndex, Location]:
    """The index of the dataset at `url` and its location. A missing index is a UserError
    (a prepare that did not finish writes none)."""
    try:
        loc = open_location(url, storage_options)
        data = read_bytes(loc, loc.join(INDEX_NAME), _INDEX_LIMIT)
    except FileNotFoundError:
        raise UserError(f"{url}/{INDEX_NAME} does not exist: not a prepared dataset, or its prepare did not "
                        f"finish; run `harness data prepare ... --out {url}`") from None
    except CheckpointError as e:
        raise UserError(f"dataset {url}: {e}") from None
    return ShardIndex.from_json(data, f"{url}/{INDEX_NAME}"), loc
