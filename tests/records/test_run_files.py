"""A run's logs are its own. A remote run dir gets a log folder no other run dir
shares, every log record carries the run id kept in run.json, and a run refuses to append to the
logs of another run."""

import json

from procs import TINY, assert_one_line_error, harness

FAST = ["--set", "train.steps=2", "--set", "checkpoint.every_steps=1"]


def test_remote_run_dirs_never_share_a_log_folder():
    from harness.records.run_files import log_dir_for

    dirs = [log_dir_for(url) for url in ("s3://harness-runs/quickstart", "s3://other-bucket/quickstart",
                                         "gs://harness-runs/quickstart", "s3://harness-runs/quickstart/")]
    assert dirs[0] == dirs[3]  # a trailing slash names the same run dir
    assert len(set(dirs[:3])) == 3 and "runs/quickstart" not in dirs
    assert dirs[0].startswith("runs/s3-harness-runs-quickstart-")
    assert log_dir_for("/data/quickstart") == "/data/quickstart"  # a local run dir keeps its logs in itself


def test_every_record_carries_the_run_id_of_run_json_across_restarts(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), *FAST, check=True)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=3", "--set", "checkpoint.every_steps=1",
            "--allow-config-change", check=True)
    assert json.loads((run / "run.json").read_text())["run_id"] == run_id
    for name in ("metrics.jsonl", "events.jsonl"):
        records = [json.loads(line) for line in (run / name).read_text().splitlines()]
        assert records and {r["run_id"] for r in records} == {run_id}, name


def test_a_run_refuses_to_append_to_the_logs_of_another_run(tmp_path):
    logs = tmp_path / "shared-logs"
    first, second = tmp_path / "first", tmp_path / "second"
    harness("train", str(TINY), "--run-dir", str(first), "--set", f'log_dir="{logs}"', *FAST, check=True)
    before = {name: (logs / name).read_bytes() for name in ("metrics.jsonl", "events.jsonl")}
    proc = harness("train", str(TINY), "--run-dir", str(second), "--set", f'log_dir="{logs}"', *FAST)
    assert_one_line_error(proc, "holds the logs of another run")
    assert str(first) in proc.stderr and "log_dir" in proc.stderr
    assert {name: (logs / name).read_bytes() for name in before} == before  # nothing appended or cut
