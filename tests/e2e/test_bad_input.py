"""Bad input to `harness train`: one line naming the problem, exit code 2, nothing half-written."""

import pytest

from procs import TINY, assert_one_line_error, harness

CASES = {
    "unknown config key": (["--set", "train.stepz=3"], "train.stepz: unknown key"),
    "wrong type": (["--set", "train.steps=abc"], "train.steps: Input should be a valid integer"),
    "negative steps": (["--set", "train.steps=-1"], "train.steps: Input should be greater than 0"),
    "missing corpus file": (["--set", "data.url=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt' not found"),
    "unknown optimizer type": (["--set", "optim.type=adamx"], "unknown type 'adamx'"),
    "a key the optimizer type does not use": (["--set", "optim.type=sgdm", "--set", "optim.weight_decay=0.5"],
                                              "optim.weight_decay: unknown key for optim.type = 'sgdm'"),
    "missing config file": (None, "does not exist"),
    "a writer core not this process's": (["--set", "checkpoint.writer_cores=[4096]"],
                                          "checkpoint.writer_cores names core(s) [4096] this process may not run on"),
    "an unknown host heap": (["--set", "train.host_heap=forever"],
                             "train.host_heap: Input should be 'keep' or 'system'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    args, needle = CASES[case]
    run = tmp_path / "run"
    config = str(tmp_path / "nope.toml") if args is None else str(TINY)
    proc = harness("train", config, "--run-dir", str(run), *(args or []))
    assert_one_line_error(proc, needle)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = harness("train", str(TINY), "--run-dir", str(blocker / "run"))
    assert_one_line_error(proc, "cannot write to run dir")


def test_incompatible_checkpoint_other_model_width(tmp_path):
    run = tmp_path / "run"
    harness("train", str(TINY), "--run-dir", str(run), "--set", "train.steps=4", check=True)
    before = harness("ckpt", "verify", str(run))
    assert before.returncode == 0

    wider = ["--set", "train.steps=4", "--set", "model.args.d_model=48"]  # refused before "already finished"
    refused = harness("train", str(TINY), "--run-dir", str(run), *wider)
    assert_one_line_error(refused, "model.args.d_model")

    forced = harness("train", str(TINY), "--run-dir", str(run), *wider, "--set", "train.steps=8",
                     "--allow-config-change")
    assert_one_line_error(forced, "model/tok_emb.weight: checkpoint float32[256, 32], live float32[256, 48]")
    assert "train this setup in a new run dir" in forced.stderr  # no `harness train` option to skip tensors
    assert "or skip these tensors by name" not in forced.stderr
    assert harness("ckpt", "verify", str(run)).returncode == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004"]
