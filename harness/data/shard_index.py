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

from harness.errors import StorageError, UserError
from harness.storage.location import Location, open_location, read_bytes

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
            if not isinstance(doc, dict):
                raise ValueError(f"it holds a JSON {type(doc).__name__}, not an object")
            if doc.get("format") != FORMAT_VERSION:
                raise ValueError(f"its format is {doc.get('format')!r}, this harness reads format {FORMAT_VERSION}")
            dtype = _required(doc, "dtype", "the index")
            if dtype not in DTYPES:
                raise ValueError(f"its dtype {dtype!r} is not one of {sorted(DTYPES)}")
            shards = tuple(_shard_entry(s, f"shards[{n}]") for n, s in enumerate(_required(doc, "shards", "the index")))
            tokenizer = _required(doc, "tokenizer", "the index")
            for key in ("vocab_size", "eod_id"):
                int(_required(tokenizer, key, "the index's tokenizer"))
            index = cls(dict(tokenizer), dtype, shards)
        except (ValueError, TypeError) as e:
            raise UserError(f"{where} is not a token-shard index: {e}; run `harness data prepare` to make "
                            f"one") from None
        if not shards or any(s.tokens < 1 or "/" in s.name for s in shards):
            raise UserError(f"{where} lists no shards or an empty/odd shard; prepare the dataset again")
        return index


def _required(record: Any, key: str, within: str) -> Any:
    """`record[key]`; a ValueError saying in words what is missing when it is not there."""
    if not isinstance(record, dict):
        raise ValueError(f"{within} is a JSON {type(record).__name__}, not an object")
    if key not in record:
        raise ValueError(f"{within} has no {key!r} entry")
    return record[key]


def _shard_entry(record: Any, within: str) -> ShardEntry:
    return ShardEntry(str(_required(record, "name", within)), int(_required(record, "tokens", within)),
                      int(_required(record, "documents", within)), str(_required(record, "sha256", within)))


def read_index(url: str, storage_options: dict | None = None) -> tuple[ShardIndex, Location]:
    """The index of the dataset at `url` and its location. A missing index is a UserError
    (a prepare that did not finish writes none)."""
    try:
        loc = open_location(url, storage_options)
        data = read_bytes(loc, loc.join(INDEX_NAME), _INDEX_LIMIT)
    except NotADirectoryError:
        raise UserError(f"{url} is a file, not a dataset folder: pass the folder that `harness data prepare "
                        f"--out` wrote") from None
    except FileNotFoundError:
        raise UserError(f"{url}/{INDEX_NAME} does not exist: not a prepared dataset, or its prepare did not "
                        f"finish; run `harness data prepare ... --out {url}`") from None
    except StorageError as e:
        raise UserError(f"dataset {url}: {e}") from None
    return ShardIndex.from_json(data, f"{url}/{INDEX_NAME}"), loc
