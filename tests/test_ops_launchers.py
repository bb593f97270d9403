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


def test_slurm_script_names_the_harness_exit_codes():
    text = (OPS / "slurm/train.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert re.search(r"#SBATCH --signal=B:USR1@\d+", text)
    for code, name in exit_codes.NAMES.items():
        assert f"{name.upper()}={code}" in text  # behaviour: tests/distributed/test_launchers.py


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
    assert sorted(codes["Ignore"]) == sorted(exit_codes.REQUEUE | exit_codes.RETRY_LATER)
    assert exit_codes.GAVE_UP not in codes["Ignore"]  # counted toward backoffLimit

    [container] = pod["containers"]
    # The run's logs are on the persistent volume, not on the pod's own disk.
    args = container["command"]
    log_dir = args[args.index("--set", args.index("--run-dir")) + 1].removeprefix("log_dir=")
    [mount] = [m for m in container["volumeMounts"] if log_dir.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == docs["PersistentVolumeClaim"]["metadata"]["name"]
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
