"""The launchers in ops/: they parse, and they agree with harness/exit_codes.py and the config."""

import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from torch.distributed import TCPStore

from harness import exit_codes
from harness.config import batch_shape, load_config

OPS = Path(__file__).resolve().parents[2] / "ops"
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


def _manifests(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((OPS / "k8s" / name).read_text())}


def _assert_failure_policy_matches_the_exit_codes(job: dict) -> None:
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # required by podFailurePolicy
    codes = {rule["action"]: rule["onExitCodes"]["values"]
             for rule in job["podFailurePolicy"]["rules"] if "onExitCodes" in rule}
    assert codes["FailJob"] == [exit_codes.USER_ERROR]
    assert sorted(codes["Ignore"]) == sorted(exit_codes.REQUEUE | exit_codes.RETRY_LATER)
    assert exit_codes.GAVE_UP not in codes["Ignore"]  # counted toward backoffLimit


def test_k8s_job_policy_matches_the_exit_codes(tmp_path):
    docs = _manifests("train-job.yaml")
    job = docs["Job"]["spec"]
    pod = job["template"]["spec"]
    _assert_failure_policy_matches_the_exit_codes(job)

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
    # The local tier is the pod's RAM: a memory-backed emptyDir mounted where the config puts it.
    [local] = [m for m in container["volumeMounts"] if m["mountPath"] == cfg.checkpoint.local.dir]
    [volume] = [v for v in pod["volumes"] if v["name"] == local["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"


def test_k8s_elastic_job_regroups_at_every_size_its_config_splits(tmp_path):
    """Fewer replacement pods: every world size of the node range splits the global batch, the
    rendezvous is the store's Service (no training pod hosts it), the range fits parallelism."""
    docs = _manifests("train-elastic-job.yaml")
    job = docs["Job"]["spec"]
    _assert_failure_policy_matches_the_exit_codes(job)
    assert "completions" not in job  # complete once a pod succeeded: a late pod is not waited for
    [container] = job["template"]["spec"]["containers"]
    assert container["command"][0] == "ops/torchrun/train.sh"
    env = {e["name"]: e.get("value") for e in container["env"]}
    low, high = map(int, env["NNODES"].split(":"))
    assert 1 <= low < high <= job["parallelism"]
    assert "is_host=false" in env["RDZV_CONF"].split(",")
    service = docs["Service"]
    assert env["RDZV_ENDPOINT"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    store = docs["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= store["metadata"]["labels"].items()
    assert "ops/torchrun/rendezvous_store.py" in " ".join(store["spec"]["containers"][0]["command"])
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # rank 0 on any pod
    (tmp_path / "run.toml").write_text(docs["ConfigMap"]["data"]["run.toml"])
    cfg = load_config(tmp_path / "run.toml")
    for nodes in range(low, high + 1):
        batch_shape(cfg, nodes * int(env["NPROC"]))  # raises for a world size it cannot split


def test_rendezvous_store_serves_a_c10d_client():
    port_probe = socket.socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    store = subprocess.Popen([sys.executable, str(OPS / "torchrun/rendezvous_store.py"), "--host", "127.0.0.1",
                              "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in store.stdout.readline()
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        store.terminate()
        assert store.wait(30) == 0


def test_readme_documents_every_exit_code():
    text = (OPS / "README.md").read_text()
    for code, name in exit_codes.NAMES.items():
        assert re.search(rf"\|\s*{code}\s*\|\s*{name.upper()}\s*\|", text), name
