"""ops/bench/ckpt_io.py still runs (a tiny state) and reports every figure docs/bench-checkpoint.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "ckpt_io.py"


def test_bench_runs_at_a_tiny_size(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--size-mib", "4", "--repeat", "1", "--dir", str(tmp_path),
                          "--json"], check=True, capture_output=True, text=True, timeout=120).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    for key in ("save_raw_s", "save_store_s", "save_torch_s", "save_dcp_s", "load_raw_cold_s", "load_store_cold_s",
                "load_torch_warm_s", "verify_s", "rss_fresh_bytes", "rss_load_bytes", "rss_load_inplace_bytes"):
        assert figures[key] > 0, key
    assert "targets: save >= 0.9x raw" in out
    assert list(tmp_path.iterdir()) == [], "the bench cleans up after itself"
