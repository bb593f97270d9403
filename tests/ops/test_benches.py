"""ops/bench/ckpt_io.py, optim_step.py, sharded_muon.py (under torchrun), harness_overhead.py, data_wait.py,
s3_io.py, prepare_rss.py, recovery.py, goodput_model.py, scale.py, scale_local.py (under torchrun) and
save_blocking.py still run (tiny sizes) and print every figure docs/bench-checkpoint.md, docs/bench-optim.md,
docs/bench-data.md, docs/bench-scale.md, docs/checkpoint-tiers.md and README quote. They time nothing here: no
measured figure is asserted (the goodput model's are arithmetic on its defaults)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import ENV, finished, spawn

ROOT = Path(__file__).resolve().parents[2]


def bench(name: str, *args: str, launcher: tuple[str, ...] = (sys.executable,)) -> str:
    """The script's stdout; it runs forked by the session's fork server (and the `harness` processes
    it starts relay to it), or fresh where the server cannot honour the environment."""
    proc = finished(spawn([*launcher, str(ROOT / "ops" / "bench" / name), *args], cwd=ROOT,
                          env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True))
    if proc.returncode != 0:
        raise AssertionError(f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def test_optim_step_compares_ours_and_torch_muon_at_both_ns_dtypes():
    out = bench("optim_step.py", "--d", "32", "--blocks", "1", "--vocab", "64", "--ctx", "16", "--reps", "1")
    for row in ("| ours, fp32 NS |", "| torch.optim.Muon, fp32 NS |", "| ours, bf16 NS |",
                "| torch.optim.Muon, bf16 NS |", "| fp32 |", "| bf16 |", "| 32 x 32 |", "| 128 x 32 |", "| 32 x 128 |",
                "| muon |", "Bundle dispatch overhead"):
        assert row in out, row


@pytest.mark.parametrize("contender", ["harness", "strict-cnr"])
def test_harness_overhead_reports_both_clocks(contender):
    out = bench("harness_overhead.py", "--steps", "4", "--warmup", "1", "--rounds", "1", "--contender", contender)
    assert "round 1: CPU ms/step bare" in out
    for clock in ("cpu", "wall"):
        assert f"median {contender} / bare, {clock}:" in out
        assert "all rounds together" in out and "geometric mean" in out


def test_sharded_muon_bench_runs_both_contenders_and_they_agree():
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    out = bench("sharded_muon.py", "--dim", "32", "--blocks", "1", "--reps", "1", launcher=torchrun)
    assert "first step bitwise equal: True" in out
    for row in ("| ours (owner per matrix) |", "| gather everything |", "ours / gather-everything: wall"):
        assert row in out, row


def test_data_wait_reports_the_share_of_the_step_spent_waiting_for_data():
    out = bench("data_wait.py", "--steps", "3", "--warmup", "1", "--configs", "quickstart", "--workers", "0")
    assert "| config | num_workers | step, median | wait for data, share of step time |" in out
    assert "| quickstart | 0 |" in out


def test_s3_io_bench_pinned_reports_every_figure():
    pinned = ["--server-cpus", str(max(os.sched_getaffinity(0)))] if len(os.sched_getaffinity(0)) > 1 else []
    text = bench("s3_io.py", "--size-mib", "2", "--repeat", "1", "--fixed-rounds", "2", *pinned)
    text = "\n" + text  # the store's log lines come first, then the JSON
    out = json.loads(text[text.rindex("\n{\n"):])
    assert set(out["mib_per_s"]) == {"store_save", "boto3_upload", "boto3_download", "store_load", "store_verify"}
    assert set(out["fixed_seconds"]) == {"store_save", "boto3_upload"}
    assert out["save_ratio_store_vs_boto3"] > 0 and out["load_ratio_store_vs_boto3"] > 0
    # the smallest model is one 16 MiB layer: two parts, so both saves complete a multipart upload
    assert all(len(v) == 1 and v[0] > 0 for v in out["completion_seconds"].values()), out["completion_seconds"]
    assert out["save_ratio_less_completion"] > 0


def test_prepare_rss_reports_peak_rss_at_both_sizes_and_the_ratio():
    out = json.loads(bench("prepare_rss.py", "--sizes-mb", "1,2", "--rows-per-group", "100"))
    assert out["sizes_mb"] == [1, 2]
    for kind in ("parquet", "save_to_disk"):
        assert out[kind]["rss_ratio"] > 0
        for size in ("1mb", "2mb"):
            assert set(out[kind][size]) == {"input_mib", "peak_rss_mib", "wall_s", "tokens"}
            assert out[kind][size]["tokens"] > 0


def test_recovery_bench_runs_all_three_arms_and_reports_every_figure():
    """ops/bench/recovery.py at a tiny size: the local-disk, S3 (its own moto server) and S3 + local
    tier arms each resume once and print what docs/checkpoint-tiers.md quotes."""
    out = bench("recovery.py", "--steps", "8", "--failures", "1", "--persistent-every", "4", "--local-every", "2",
                "--d-model", "16", "--layers", "1")
    for arm in ("disk", "s3", "s3+local"):
        assert f"\n{arm:<9} mean: " in out, out
    assert "(local)" in out and "local_checkpoint save" in out and "MiB" in out


def test_goodput_model_prints_the_figures_docs_quote():
    out = bench("goodput_model.py")
    figures = dict(line.split() for line in out.splitlines())
    assert figures["goodput_persistent_alone"] == "0.8068" and figures["goodput_with_local"] == "0.8974"
    assert figures["local_interval_s"] == "1,003.9" and figures["persistent_with_local_interval_s"] == "13,266.9"


def test_scale_bench_reports_every_figure_against_its_goal(tmp_path):
    out = bench("scale.py", "--sizes", "0.07", "--rounds", "1", "--cap-mib", "64", "--alone-steps", "1",
                "--dir", str(tmp_path))
    for figure in ("blocking", "vs torch copy", "save throughput (raw write+fsync / persist)",
                   "vs raw O_DIRECT write+fsync", "the step loop lost", "writer CPU",
                   "RSS a save adds: default ring", "cap 64 MiB:", "step during a background save", "restore warm",
                   "restore cold", "other processes"):
        assert figure in out, figure


def test_writer_cost_bench_reports_the_step_beside_each_design(tmp_path):
    out = bench("writer_cost.py", "--gib", "0.02", "--rounds", "1", "--steps", "1", "--dir", str(tmp_path),
                "--designs", "direct + hash inline,buffered + hash thread,hash only")
    for design in ("direct + hash inline", "buffered + hash thread", "hash only"):
        assert re.search(rf"{re.escape(design)} +step [0-9.]+x \([0-9.]+-[0-9.]+\), writer [0-9.]+ s", out), out
    assert list(tmp_path.iterdir()) == [], "the bench cleans up after itself"


def test_scale_local_bench_reports_both_ranks_with_and_without_a_cap(tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    out = bench("scale_local.py", "--sizes", "0.07", "--cap-mib", "64", "--saves", "1", "--dir", str(tmp_path),
                launcher=torchrun)
    for rank in (0, 1):
        for arm in ("default ring", "cap 64 MiB"):
            assert f"rank {rank}, {arm}: blocking" in out, (rank, arm)
    assert "saved + copied to the peer" in out and "RAM beyond the state" in out and "tmpfs held" in out


def test_save_blocking_bench_times_every_part_of_a_loop_save():
    out = bench("save_blocking.py", "--d-model", "32", "--layers", "1", "--rounds", "1")
    for part in ("finite check", "fingerprints hash, live", "torch copy", "AsyncSaver.save", "persist, after the save",
                 "a Loop save blocks for"):
        assert part in out, part


def test_ckpt_io_bench_runs_at_a_tiny_size_and_cleans_up(tmp_path):
    out = bench("ckpt_io.py", "--size-mib", "4", "--repeat", "1", "--dir", str(tmp_path), "--json")
    figures = json.loads(out.strip().splitlines()[-1])
    for key in ("save_raw_s", "save_store_s", "save_torch_s", "save_dcp_s", "load_raw_cold_s", "load_store_cold_s",
                "load_torch_warm_s", "verify_s", "rss_fresh_bytes", "rss_load_bytes", "rss_load_inplace_bytes"):
        assert figures[key] > 0, key
    assert "targets: save >= 0.9x raw" in out
    assert list(tmp_path.iterdir()) == [], "the bench cleans up after itself"
