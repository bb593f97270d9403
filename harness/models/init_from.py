"""`model.init_from`: a fresh run's model starts from saved weights instead of its random init.

`load_initial_weights(model, url)` reads a safetensors file, or a folder holding
`model.safetensors` (or `model.safetensors.index.json` and the shards it names: a Hugging Face
model folder, `harness ckpt export`'s output), into `model`'s state dict by name, and returns
what it read: every file's name, size and sha256 (the digest the Hugging Face hub shows),
which `harness train` records in run.json. Each byte is read once and hashed as it is read
(`HashingReader`), straight into the live tensor when dtype and device allow.

Strict, so a start never silently keeps part of the random init: every tensor of the state dict
must be in the files (a tied one once, under any of its names: the output head sharing the
token embedding), no file tensor may be left over, shapes must match. The file's dtype is
converted to the model's (a bfloat16 export into float32 training). Loaded at step 0 only, by
the trainer of a fresh start, before sharding (the caller's order): a resume restores the
checkpoint and never opens these files.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from harness.checkpoint.format import tensor_view
from harness.checkpoint.tensorfile import read_header, read_tensor
from harness.errors import StorageError, UserError
from harness.storage.location import HashingReader, Location, open_location, open_read

SETTING = "model.init_from"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DIGEST = "sha256"
_MAX_INDEX_BYTES = 64 << 20


def load_initial_weights(model: nn.Module, url: str) -> dict[str, Any]:
    """Load the weights at `url` into `model` (module docstring); returns the record for
    run.json: {"url", "files": [{"name", "bytes", "sha256"}]}. UserError naming `url` when it
    is missing, not safetensors, or does not hold exactly the model's tensors."""
    loc, names = _weight_files(url)
    targets = model.state_dict()
    aliases = _aliases(targets)
    loaded: set[str] = set()
    files = []
    with torch.no_grad():
        for name in names:
            files.append(_load_file(loc, name, targets, loaded, url))
    missing = sorted({aliases[k] for k in targets} - {aliases[k] for k in loaded})
    if missing:
        raise UserError(f"{SETTING} = {url!r} lacks {len(missing)} of the model's tensors: "
                        f"{', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}; the model would keep "
                        "its random init there. Give weights saved from this architecture "
                        "(names as the model's state_dict)")
    return {"url": url, "files": files}


def _weight_files(url: str) -> tuple[Location, list[str]]:
    """(the location of the files, their names in it): the file itself, the folder's
    model.safetensors, or the shards its model.safetensors.index.json names."""
    try:
        loc = open_location(url)
    except StorageError as e:
        raise UserError(f"{SETTING} = {url!r}: {e}") from None
    fs = loc.fs
    if fs.isfile(loc.root):
        parent, _, name = loc.root.rpartition("/")
        return Location(fs, parent or "/", url), [name]
    if not fs.isdir(loc.root):
        hub = (" (a Hugging Face hub id is not downloaded: the harness reads local files and storage URLs only; "
               f"download it first, e.g. huggingface-cli download {url} --local-dir DIR, and give DIR)"
               if url.count("/") == 1 and not url.startswith((".", "/", "~")) else "")
        raise UserError(f"{SETTING} = {url!r}: no such file or folder{hub}")
    if fs.isfile(loc.join(WEIGHTS_FILE)):
        return loc, [WEIGHTS_FILE]
    if not fs.isfile(loc.join(INDEX_FILE)):
        raise UserError(f"{SETTING} = {url!r}: the folder holds neither {WEIGHTS_FILE} nor {INDEX_FILE}; give a "
                        "safetensors file or a saved model's folder")
    try:
        with open_read(loc, loc.join(INDEX_FILE)) as f:
            weight_map = json.loads(f.read(_MAX_INDEX_BYTES))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{SETTING} = {url!r}: {INDEX_FILE} is not a safetensors index ({type(e).__name__}: {e})"
        ) from None
    return loc, names


def _aliases(targets: dict[str, torch.Tensor]) -> dict[str, str]:
    """State-dict name -> the first name of the same tensor (tied weights are one tensor)."""
    first: dict[tuple, str] = {}
    return {name: first.setdefault(tensor_view(t), name) for name, t in targets.items()}


def _load_file(loc: Location, name: str, targets: dict[str, torch.Tensor], loaded: set[str],
               url: str) -> dict[str, Any]:
    """Read one safetensors file into `targets`, hashing every byte; its record."""
    path = loc.join(name)
    where = loc.url_of(path)
    try:
        size = loc.fs.size(path)
        with HashingReader(open_read(loc, path, prefetch=True), DIGEST) as f:
            entries = read_header(f, size, where)
            unknown = sorted(set(entries) - set(targets))
            if unknown:
                raise UserError(f"{SETTING} = {url!r}: {where} holds {len(unknown)} tensor(s) the model "
                                f"does not have: {', '.join(unknown[:6])}{', ...' if len(unknown) > 6 else ''}; "
                                "give weights saved from this architecture (names as the model's state_dict)")
            for entry in sorted(entries.values(), key=lambda e: e.start):  # the reader only moves forward
                live = targets[entry.name]
                if entry.shape != tuple(live.shape):
                    raise UserError(f"{SETTING} = {url!r}: {entry.name} is {entry.describe()} in {where}, the "
                                    f"model's is {list(live.shape)}; the weights are of another model size")
                if entry.dtype == live.dtype:
                    read_tensor(f, entry, where, out=live)
                else:  # read as stored, then converted: the bytes of one dtype never land in another's storage
                    live.copy_(read_tensor(f, entry, where))
                loaded.add(entry.name)
            nbytes, digest = f.finish()
    except FileNotFoundError:
        raise UserError(f"{SETTING} = {url!r}: {where} does not exist (named by {INDEX_FILE})") from None
    except StorageError as e:  # not a safetensors file, truncated
        raise UserError(f"{SETTING} = {url!r}: {e}") from None
    return {"name": name, "bytes": nbytes, DIGEST: digest}
