"""The run's files: `run.json` in the run dir, and the one rule for where its logs live.

Where the logs live (`log_dir_for(run_dir, log_dir)`: `events.jsonl` and `metrics.jsonl`): in
`log_dir` when given, else in the run dir itself when that is a local folder. Object stores
cannot append, and rewriting the whole object per event would be quadratic and racy, so for a
remote run dir the logs are kept locally in `runs/<protocol-host-path>-<hash>/`: the readable
part is the URL with every run of characters other than letters, digits, `.`, `_` and `-`
turned into one `-` (cut to 80 characters), the hash the first 8 hex digits of the sha256 of
the whole URL, so two run dirs never share a log folder (s3://a/quickstart and a local
runs/quickstart did, when the folder was named after the last path component alone).

`run.json` (`harness.records.run_id.RUN_JSON`) holds the run id, the resolved config, the data's
identity, the environment and, for a run whose model started from `model.init_from`, what step 0
loaded (`init_from`: the URL and each file's name, size and sha256; written by the fresh start,
kept by every resume, which never reads those files) and `starts`, the step each start of
training resumed from, in order (0: a fresh start; what tells a local checkpoint on the run's
timeline from one a later resume abandoned, checkpoint/save/local_tier.py); it is written by rank 0 of every process
that trains the run dir and read by `harness compare` (the config) and `harness ckpt gc` (the
retention policy).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.utils import get_protocol

from harness.errors import UserError
from harness.records.events import EVENTS_FILE
from harness.records.jsonlines import parse_line
from harness.records.run_id import RUN_ID_KEY, RUN_JSON, new_run_id

if TYPE_CHECKING:
    from harness.config import RunConfig

METRICS_FILE = "metrics.jsonl"
INIT_KEY = "init_from"  # run.json: what the model's weights started from (model.init_from)
STARTS_KEY = "starts"  # run.json: the step each start of training resumed from, in order
LOGS_ROOT = "runs"


def log_dir_for(run_dir: str, log_dir: str | None = None) -> str:
    """The local folder of the logs of the run at `run_dir` (see the module docstring)."""
    if log_dir:
        return log_dir
    if get_protocol(run_dir) in ("file", "local"):
        return fsspec.core.strip_protocol(run_dir)
    url = run_dir.rstrip("/")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", url).strip("-")[:80]
    return os.path.join(LOGS_ROOT, f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:8]}")


def events_url(run_dir: str, log_dir: str | None = None) -> str:
    """The events file of the run at `run_dir`."""
    return os.path.join(log_dir_for(run_dir, log_dir), EVENTS_FILE)


def metrics_url(run_dir: str, log_dir: str | None = None) -> str:
    """The metrics file of the run at `run_dir`."""
    return os.path.join(log_dir_for(run_dir, log_dir), METRICS_FILE)


def write_run_json(cfg: RunConfig, data_identity: Any, environment: dict[str, Any], *, started_from: int,
                   fresh: bool, initialised_from: dict[str, Any] | None = None) -> tuple[str, int]:
    """Write the run dir's run.json (resolved config, data identity, environment, run id,
    `init_from`: `initialised_from` on a `fresh` start, else the one run.json holds, and `starts`
    with `started_from`, the step this start resumed from, appended) and return (the run id: the
    one already in run.json, else a new one (`harness.records.run_id`); this start's index in
    `starts`)."""
    # Imported here: harness.config imports torch (see `_previous_run_json`).
    from harness.config import public_config
    from harness.storage.filesystem import open_filesystem

    try:
        previous = _previous_run_json(cfg)
        run_id = (previous or {}).get(RUN_ID_KEY) or new_run_id()
        starts = [*(previous or {}).get(STARTS_KEY, []), started_from]
        doc = {RUN_ID_KEY: run_id, "config": public_config(cfg), "data": data_identity,
               "environment": environment, STARTS_KEY: starts}
        init = initialised_from if fresh else (previous or {}).get(INIT_KEY)
        if init is not None:
            doc[INIT_KEY] = init
        fs, path = open_filesystem(cfg.run_dir, cfg.checkpoint.storage_options)
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(f"{path.rstrip('/')}/{RUN_JSON}", json.dumps(doc, indent=2).encode())
    except OSError as e:
        raise UserError(f"cannot write to run dir {cfg.run_dir}: {e}; choose a writable --run-dir") from None
    return run_id, len(starts) - 1


def existing_run(cfg: RunConfig) -> tuple[str | None, list[int]]:
    """(the run id the run dir's run.json holds, or None before the run's first start: what a local
    checkpoint tier is keyed by; the step each start so far resumed from: which of its checkpoints
    lie on the run's timeline, harness/checkpoint/save/local_tier.py)."""
    try:
        previous = _previous_run_json(cfg) or {}
        return previous.get(RUN_ID_KEY), [int(step) for step in previous.get(STARTS_KEY, [])]
    except OSError as e:
        raise UserError(f"cannot read run dir {cfg.run_dir}: {e}; check --run-dir") from None


def _previous_run_json(cfg: RunConfig) -> dict[str, Any] | None:
    # Imported here: the log-dir rule above serves the supervisor and `harness report`, which
    # need no torch (harness.checkpoint imports it). Through the store's filesystem: bounded
    # retries that never draw from the global RNG.
    from harness.storage.filesystem import open_filesystem

    fs, path = open_filesystem(cfg.run_dir, cfg.checkpoint.storage_options)
    url = f"{path.rstrip('/')}/{RUN_JSON}"
    return parse_line(fs.cat_file(url)) if fs.exists(url) else None


def refuse_a_file(run_dir: str) -> None:
    """UserError when `run_dir` is a local file: the commands that read a run take its folder."""
    if get_protocol(run_dir) in ("file", "local") and os.path.isfile(fsspec.core.strip_protocol(run_dir)):
        raise UserError(f"{run_dir} is a file, not a run dir: pass the folder given to `harness train` "
                        "as its run dir")


def read_run_json(run_dir: str) -> dict[str, Any]:
    """The resolved config recorded in the run dir's run.json; UserError when there is none."""
    refuse_a_file(run_dir)
    url = f"{run_dir.rstrip('/')}/{RUN_JSON}"
    try:
        with fsspec.open(url, "r") as f:
            return json.load(f)["config"]
    except FileNotFoundError:
        raise UserError(f"no run.json in {run_dir}: pass the run dir of a `harness train` run") from None
    except (json.JSONDecodeError, KeyError) as e:
        raise UserError(f"{url} is not a run.json written by `harness train` ({e})") from None
