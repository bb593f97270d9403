"""`harness ckpt export CKPT --format hf --out DIR`: a checkpoint as a Hugging Face model folder.

For a run whose model is a `transformers` causal LM (`model.factory =
"harness.models.hf:causal_lm"`), DIR gets what `save_pretrained` writes, so
`AutoModelForCausalLM.from_pretrained(DIR)`, vLLM and llama.cpp's converters open it:
- `config.json`: the model's config as the run built it (every checkpoint's meta holds it,
  `HarnessForward.hf_config`), `dtype` the exported one;
- `model.safetensors`, or past `max_shard_bytes` the files `model-0000K-of-0000N.safetensors`
  and `model.safetensors.index.json` (the weight map and total size, as transformers writes
  them); tensors under transformers' own names, a tied tensor once (under its first name: the
  token embedding, not the head; transformers ties the head to it again);
- `generation_config.json`, from the config (transformers' own `from_model_config`);
- the tokenizer the run's data came from: a token-shard dataset's `tokenizer.json` (checked
  against the sha256 its index records, the index against the checkpoint's data identity) and a
  `tokenizer_config.json` naming the fast tokenizer class and the end-of-document token. Byte
  text and a `data.factory` have none, and a dataset no longer where the run read it is not
  guessed at: the returned notes say so.
The tensors come from `consolidate.whole_tensors`, whole and one at a time, from any world size
and sharding, after the checkpoint verified (`open_verified`), optionally converted to another
floating dtype (`--dtype bfloat16`; integer buffers stay as they are). DIR must be new or empty,
so no file of an earlier export (another sharding) can mix in; a failed export removes what it wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.checkpoint.consolidate import MODEL_PART, Whole, open_verified, whole_tensors
from harness.checkpoint.discovery import CheckpointRef
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import tensor_refs
from harness.checkpoint.loading import Checkpoint
from harness.checkpoint.store import CheckpointStore
from harness.checkpoint.tensorfile import stream
from harness.data.shard_index import TOKENIZER_NAME, read_index
from harness.errors import UserError
from harness.models.hf import CONFIG_FILE, FACTORY, HF_CONFIG_META, import_transformers
from harness.storage.location import Location, output_folder, write_small, write_stream

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclass
class Exported:
    """What an export wrote: the folder's URL, the file names and their total bytes, and notes
    for the user (what was not written and why)."""

    url: str
    files: list[str] = field(default_factory=list)
    nbytes: int = 0
    notes: list[str] = field(default_factory=list)


def export_hf(store: CheckpointStore, ref: CheckpointRef, out: str, *, dtype: str | None = None,
              max_shard_bytes: int, storage_options: dict | None = None) -> Exported:
    """Write `ref` as a Hugging Face model folder at `out` (module docstring); `dtype` a key of
    DTYPES or None (the checkpoint's). Raises `CheckpointError` (a UserError) for a damaged
    checkpoint, one whose model is not a transformers model, or an `out` that is a file, not
    empty, or not writable."""
    checkpoint = open_verified(store, ref)
    config = checkpoint.state.get("meta", {}).get(HF_CONFIG_META)
    if config is None:
        factory = checkpoint.state.get("meta", {}).get("config", {}).get("model", {}).get("factory")
        raise CheckpointError(f"{ref.url}: its model (model.factory = {factory!r}) is not a transformers model, so "
                              f"there is no config.json to export; --format hf takes runs of {FACTORY!r} "
                              "(`harness ckpt consolidate` writes any model's tensors)")
    transformers = import_transformers()
    dest = output_folder(out, storage_options, "--out")
    if dest.fs.ls(dest.root):
        raise CheckpointError(f"--out {out} is not empty; give a new or empty folder (an earlier export's files "
                              "would mix with this one's)")
    done = Exported(dest.url)
    tokenizer = tokenizer_files(checkpoint, done.notes)
    try:
        _export(transformers, store, checkpoint, config, dest, DTYPES[dtype] if dtype else None, max_shard_bytes,
                tokenizer, done)
    except BaseException as e:
        for name in done.files:  # nothing half-written is left behind
            with contextlib.suppress(OSError):
                dest.fs.rm(dest.join(name))
        if isinstance(e, OSError):  # a full disk, a read-only folder: the user's to fix
            raise CheckpointError(f"cannot write the export to --out {out}: {e}; nothing was left there") from None
        raise
    return done


def _export(transformers: Any, store: CheckpointStore, checkpoint: Checkpoint, config: dict[str, Any],
            dest: Location, target: torch.dtype | None, max_shard_bytes: int, tokenizer: dict[str, bytes],
            done: Exported) -> None:
    """Write the weights, config.json, generation_config.json and `tokenizer` into `dest`,
    naming each file in `done` before it is written."""
    with whole_tensors(store, checkpoint, MODEL_PART) as (specs, produce):
        specs = {name: specs[name] for name in distinct_names(checkpoint)}
        specs, produce = _converted(specs, produce, target)
        _write_weights(dest, specs, produce, max_shard_bytes, done)
    hf_config = transformers.AutoConfig.for_model(**config)
    hf_config.dtype = target or _floating_dtype(specs)
    _write(dest, CONFIG_FILE, hf_config.to_json_string().encode(), done)  # as save_pretrained writes it
    generation = transformers.GenerationConfig.from_model_config(hf_config)
    _write(dest, GENERATION_FILE, generation.to_json_string().encode(), done)
    for name, data in tokenizer.items():
        _write(dest, name, data, done)


def distinct_names(checkpoint: Checkpoint) -> list[str]:
    """The model part's tensor names in state-dict order, each stored tensor once: a tied one
    (several key paths naming one stored tensor) under its first name."""
    seen: set[tuple[str, str]] = set()
    names = []
    for path, stored in tensor_refs(checkpoint.state["parts"][MODEL_PART]).items():
        if stored not in seen:
            seen.add(stored)
            names.append("/".join(map(str, path)))
    return names


def _converted(specs: dict[str, Whole], produce: Callable[[str], torch.Tensor],
               target: torch.dtype | None) -> tuple[dict[str, Whole], Callable[[str], torch.Tensor]]:
    """`specs` and `produce` with every floating tensor in `target` (None: as stored)."""
    if target is None:
        return specs, produce

    def dtype_of(w: Whole) -> torch.dtype:
        return target if w.dtype.is_floating_point else w.dtype

    return ({n: Whole(dtype_of(w), w.shape) for n, w in specs.items()},
            lambda name: produce(name).to(dtype_of(specs[name])))


def _floating_dtype(specs: dict[str, Whole]) -> torch.dtype:
    return next((w.dtype for w in specs.values() if w.dtype.is_floating_point), torch.float32)


def shard_plan(specs: dict[str, Whole], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in name order, cut into files of at most `max_shard_bytes` (a larger tensor
    alone in its own file), as transformers' `save_pretrained` shards."""
    files: list[list[str]] = [[]]
    size = 0
    for name in sorted(specs):
        n = specs[name].dtype.itemsize * math.prod(specs[name].shape)
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain number (transformers' units: GB = 10^9,
    GiB = 2^30); ValueError for anything else or a size below one byte."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or int(match[1]) < 1:
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(match[1]) * _UNITS[(match[2] or "").upper()]


def _write_weights(dest: Location, specs: dict[str, Whole], produce: Callable[[str], torch.Tensor],
                   max_shard_bytes: int, done: Exported) -> None:
    plan = shard_plan(specs, max_shard_bytes)
    names = [WEIGHTS_FILE] if len(plan) == 1 else \
        [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    for name, members in zip(names, plan, strict=True):
        done.files.append(name)
        size, _ = write_stream(dest, dest.join(name), stream({n: specs[n] for n in members}, produce))
        done.nbytes += size
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(w.dtype.itemsize * math.prod(w.shape) for w in specs.values())},
                 "weight_map": {n: name for name, members in zip(names, plan, strict=True) for n in members}}
        _write(dest, INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), done)


def _write(dest: Location, name: str, data: bytes, done: Exported) -> None:
    done.files.append(name)
    write_small(dest, dest.join(name), data)
    done.nbytes += len(data)


def tokenizer_files(checkpoint: Checkpoint, notes: list[str]) -> dict[str, bytes]:
    """The tokenizer files of the run's data ({} and a note in `notes` when there are none, or
    the dataset is not where the run read it, or it changed since)."""
    data = checkpoint.state.get("meta", {}).get("config", {}).get("data", {})
    sources = data.get("sources") or []
    if not sources:
        kind = "data.factory (its own samples)" if data.get("factory") else "byte-level text (ids are the bytes 0..255)"
        notes.append(f"no tokenizer written: the run trained on {kind}, which has no tokenizer.json")
        return {}
    url = sources[0]["url"]
    recorded = checkpoint.state["meta"].get("data") or {}
    try:
        index, loc = read_index(url, _usable(sources[0].get("storage_options") or data.get("storage_options")))
        tokenizer = loc.fs.cat_file(loc.join(TOKENIZER_NAME))
    except (UserError, OSError) as e:
        notes.append(f"no tokenizer written: the run's dataset {url} cannot be read here ({e}); copy its "
                     f"{TOKENIZER_NAME} into the folder")
        return {}
    if index.sha256 != recorded.get("sources", [{}])[0].get("index_sha256") or \
            hashlib.sha256(tokenizer).hexdigest() != index.tokenizer.get("sha256"):
        notes.append(f"no tokenizer written: the dataset at {url} is no longer the one the run trained on (its "
                     f"index or {TOKENIZER_NAME} changed); copy the right {TOKENIZER_NAME} into the folder")
        return {}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": index.tokenizer.get("eod_token")}
    return {TOKENIZER_NAME: tokenizer,
            TOKENIZER_CONFIG_FILE: (json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n").encode()}


def _usable(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """Storage options as run.json/the checkpoint recorded them, without the redacted credentials."""
    kept = {k: v for k, v in (options or {}).items() if v != "<redacted>"}
    return kept or None
