"""Two small prepared token-shard datasets (byte tokenizer) for training tests, and the
`--set` arguments that train on them mixed 0.7 / 0.3."""

from __future__ import annotations

import json
from pathlib import Path

from harness.data.corpus import default_corpus
from harness.data.prepare import PrepareSpec, prepare


def make_sources(folder: Path) -> tuple[str, str]:
    """Two datasets from the two halves of the built-in corpus, one document per line, small
    shards so windows cross shard boundaries."""
    lines = default_corpus().decode("ascii").splitlines()
    urls = []
    for name, part in (("a", lines[: len(lines) // 2]), ("b", lines[len(lines) // 2 :])):
        text = folder / f"{name}.txt"
        text.write_text("\n".join(part) + "\n")
        prepare(PrepareSpec((str(text),), "bytes", text_split="line", shard_tokens=20000), str(folder / name))
        urls.append(str(folder / name))
    return urls[0], urls[1]


def sources_args(a: str, b: str, *, workers: int = 0) -> list[str]:
    sources = f"[{{url = {json.dumps(a)}, weight = 0.7}}, {{url = {json.dumps(b)}, weight = 0.3}}]"
    return ["--set", f"data.sources={sources}", "--set", f"data.num_workers={workers}"]


def batch_hashes(log_dir: Path) -> dict[int, str]:
    """step -> batch hash (the global batch's sample ids) from metrics.jsonl."""
    out = {}
    for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "batch_hash" in rec:
            out[rec["step"]] = rec["batch_hash"]
    return out
