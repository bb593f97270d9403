"""`harness data prepare` peak memory against input size: parquet and save_to_disk folders.

Generates the same kind of text at two sizes (`--sizes-mb`, default 20 and 200 MB of UTF-8
text: documents of 200-8,000 characters of words drawn from a fixed vocabulary, seeded), written
as a parquet file (snappy, one row group per `--rows-per-group` documents, an `id` column beside
`text`, as FineWeb-style corpora are) and as a folder laid out as `datasets`' `save_to_disk` lays
it out (arrow IPC streams of 1,000-row record batches, state.json). Each input is prepared by
`harness data prepare INPUT --tokenizer bytes --workers 0` in a child process of its own; its
peak RSS is that child's `ru_maxrss` (os.wait4). Reading streams one record batch of the text
column at a time, so peak RSS should not grow with the file: the larger input's ratio to the
smaller's is the figure (target: within 5%). What does scale with the row group: pyarrow reads a
row group's column chunk of a parquet file at once.

Run: `python ops/bench/prepare_rss.py` (a few minutes here; ~1 GB of temporary disk). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
ARROW_BATCH_ROWS = 1000  # datasets' ArrowWriter default writer_batch_size


def row_groups(megabytes: int, rows_per_group: int, seed: int = 0):
    """Tables of `rows_per_group` documents (an id and its text) until `megabytes` MB of text."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzäöü"))
    vocabulary = np.array(["".join(rng.choice(letters, rng.integers(1, 12))) for _ in range(20000)])
    left, first = megabytes * 1_000_000, 0
    while left > 0:
        texts = []
        for length in rng.integers(200, 8000, rows_per_group):
            words = vocabulary[rng.integers(0, len(vocabulary), length // 6)]
            texts.append(" ".join(words)[:length])
            left -= len(texts[-1].encode())
            if left <= 0:
                break
        yield pa.table({"id": np.arange(first, first + len(texts)), "text": texts})
        first += len(texts)


def write_inputs(folder: Path, megabytes: int, rows_per_group: int) -> dict[str, Path]:
    """The parquet file and the save_to_disk folder of the same `megabytes` MB of text."""
    parquet, saved = folder / f"text-{megabytes}mb.parquet", folder / f"saved-{megabytes}mb"
    saved.mkdir()
    arrow = saved / "data-00000-of-00001.arrow"
    with pq.ParquetWriter(parquet, pa.schema([("id", pa.int64()), ("text", pa.string())])) as writer, \
            pa.ipc.new_stream(arrow, pa.schema([("id", pa.int64()), ("text", pa.string())])) as stream:
        for table in row_groups(megabytes, rows_per_group):
            writer.write_table(table, row_group_size=rows_per_group)
            stream.write_table(table, max_chunksize=ARROW_BATCH_ROWS)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow.name}], "_split": None}))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {
        "id": {"dtype": "int64", "_type": "Value"}, "text": {"dtype": "string", "_type": "Value"}}}))
    return {"parquet": parquet, "save_to_disk": saved}


def prepare_peak(input_path: Path, out: Path) -> dict:
    """Prepare `input_path` in a child process: its peak RSS (MiB), wall time, tokens."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "harness.cli", "data", "prepare", str(input_path), "--out",
                              str(out), "--tokenizer", "bytes", "--workers", "0"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"prepare of {input_path} exited {child.returncode}:\n{stderr.decode()[-2000:]}")
    tokens = json.loads((out / "index.json").read_text())["totals"]["tokens"]
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "wall_s": round(time.perf_counter() - started, 1),
            "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="20,200", help="the two text sizes, MB (default 20,200)")
    parser.add_argument("--rows-per-group", type=int, default=2000,
                        help="documents per parquet row group (default 2000: ~8 MB of text)")
    parser.add_argument("--tmp", default=None, help="folder for the inputs and outputs (default: the system's)")
    args = parser.parse_args()
    small, large = (int(size) for size in args.sizes_mb.split(","))
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for megabytes in (small, large):
            inputs = write_inputs(Path(tmp), megabytes, args.rows_per_group)
            for kind, path in inputs.items():
                out = Path(tmp) / f"out-{kind}-{megabytes}"
                size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.iterdir()))
                results.setdefault(kind, {})[f"{megabytes}mb"] = {"input_mib": round(size / 2**20, 1),
                                                                  **prepare_peak(path, out)}
                shutil.rmtree(out)
            inputs["parquet"].unlink()
            shutil.rmtree(inputs["save_to_disk"])
    for sizes in results.values():
        sizes["rss_ratio"] = round(sizes[f"{large}mb"]["peak_rss_mib"] / sizes[f"{small}mb"]["peak_rss_mib"], 3)
    print(json.dumps({"sizes_mb": [small, large], "rows_per_group": args.rows_per_group, **results}, indent=2))


if __name__ == "__main__":
    main()
