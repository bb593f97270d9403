"""The launchers in ops/: they parse, and they agree with harness/exit_codes.py and the config."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import exit_codes
from harness.config import load_config

OPS = Path(__file__).resolve().parents[1] / "ops"
SHELL_SCRIPTS = [OPS / "slurm/train.sbatch", OPS / "torchrun/train.sh"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_launchers_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_slurm_script_requeues_on_the_harness_stop_codes():
    text = (OPS / "slurm/train.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert re.search(r"#SBATCH --signal=B:USR1@\d+", text)
    assert f"PREEMPTED={exit_codes.PREEMPTED}" in text
    assert f"SAVE_DEADLINE_MISSED={exit_codes.SAVE_DEADLINE_MISSED}" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


def test_torchrun_script_uses_max_restarts():
    text = (OPS / "torchrun/train.sh").read_text()
    assert re.search(r"torchrun .*--nproc-per-node .*--max-restarts .*--no-python", text)


def test_k8s_job_policy_matches_the_exit_codes(tmp_path):
    docs = {d["kind"]: d for d in yaml.safe_load_all((OPS / "k8s/train-job.yaml").read_text())}
    job = docs["Job"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    codes = {rule["action"]: rule["onExitCodes"]["values"]
             for rule in job["podFailurePolicy"]["rules"] if "onExitCodes" in rule}
    assert codes["FailJob"] == [exit_codes.USER_ERROR]
    assert sorted(codes["Ignore"]) == sorted(exit_codes.REQUEUE)

    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["RUN_DIR"]["value"].startswith("s3://")
    assert "secretKeyRef" in env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]

    # The embedded run config is a valid config, and the grace period covers its deadline.
    (tmp_path / "run.toml").write_text(docs["ConfigMap"]["data"]["run.toml"])
    cfg = load_config(tmp_path / "run.toml")
    assert pod["terminationGracePeriodSeconds"] > cfg.checkpoint.preempt_deadline_s + 10


def test_readme_documents_every_exit_code():
    text = (OPS / "README.md").read_text()
    for code, name in exit_codes.NAMES.items():
        assert re.search(rf"\|\s*{code}\s*\|\s*{name.upper()}\s*\|", text), name
