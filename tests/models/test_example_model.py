"""The user-model example of docs/models.md trains as documented, resumes
bitwise, and its tied weights are stored once in model.safetensors (old checkpoints, with the tied
tensor stored under each name, still load)."""


import pytest
import torch
from safetensors import safe_open
from torch import nn

from harness.checkpoint import CheckpointStore, load
from procs import ENV, ROOT, harness

EXAMPLES = str(ROOT / "examples")
CONFIG = "examples/tied_lm.toml"
DOCUMENTED = f"harness train {CONFIG}"
SMALL = ["--set", "train.steps=6", "--set", "checkpoint.every_steps=3", "--set", "data.seq_len=32"]


@pytest.fixture
def tied_lm(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import tied_lm

    return tied_lm


def model_keys(run, step):
    with safe_open(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_the_documented_example_trains_resumes_bitwise_and_stores_the_tie_once(tmp_path):
    assert DOCUMENTED in (ROOT / "docs" / "models.md").read_text()
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}  # tied_lm.py lies beside its config
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    harness("train", CONFIG, "--run-dir", str(straight), *SMALL, env=env, check=True)
    crashed = harness("train", CONFIG, "--run-dir", str(interrupted), *SMALL, "--set", "debug.crash_at_step=5",
                      env=env)
    assert crashed.returncode == 13, crashed.stderr[-2000:]
    harness("train", CONFIG, "--run-dir", str(interrupted), *SMALL, env=env, check=True)
    diff = harness("ckpt", "diff", f"{straight}/checkpoints/step-00000006", f"{interrupted}/checkpoints/step-00000006")
    assert diff.returncode == 0 and "bitwise equal" in diff.stdout, diff.stdout[-2000:]
    keys = model_keys(straight, 6)
    assert "tok_emb.weight" in keys and "head.weight" not in keys


def test_a_checkpoint_with_the_tie_stored_twice_still_loads(tmp_path, tied_lm):
    torch.manual_seed(0)
    saved = tied_lm.build({"seq_len": 8})
    old_style = {k: v.detach().clone() for k, v in saved.state_dict().items()}  # every name its own tensor
    store = CheckpointStore(str(tmp_path / "run"))
    ref = store.save(1, {"model": old_style})
    assert {"tok_emb.weight", "head.weight"} <= set(store.tensor_headers(ref)["model.safetensors"])
    torch.manual_seed(1)
    live = tied_lm.build({"seq_len": 8})
    load(store, ref, {"model": live})
    assert live.head.weight is live.tok_emb.weight  # the tie survives
    assert all(torch.equal(live.state_dict()[k], v) for k, v in saved.state_dict().items())


def test_a_tied_checkpoint_loads_into_an_untied_model(tmp_path, tied_lm):
    torch.manual_seed(0)
    saved = tied_lm.build({"seq_len": 8})
    store = CheckpointStore(str(tmp_path / "run"))
    ref = store.save(1, {"model": saved})
    assert "head.weight" not in store.tensor_headers(ref)["model.safetensors"]
    torch.manual_seed(1)
    untied = tied_lm.build({"seq_len": 8})
    untied.head.weight = nn.Parameter(untied.head.weight.detach().clone())
    load(store, ref, {"model": untied})
    assert torch.equal(untied.head.weight, saved.tok_emb.weight)
    assert torch.equal(untied.tok_emb.weight, saved.tok_emb.weight)
    assert untied.head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
