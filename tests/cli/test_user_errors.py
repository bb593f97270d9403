"""Inputs the README promises a one-line error and exit 2 for (no traceback,
nothing written), that gave a traceback or exit 1 before."""

import json
import os
import subprocess
import sys

import pytest

from harness.cli import main
from procs import ENV, ROOT, TINY, assert_one_line_error, events, harness

MODELS = str(ROOT / "tests" / "models")
FAST = ["--set", "train.steps=2", "--set", "checkpoint.every_steps=1"]


class Finished:
    """What `main(argv)` left: its exit code and stderr."""

    def __init__(self, capsys, argv):
        self.returncode = main(argv)
        self.stderr = capsys.readouterr().err


@pytest.mark.parametrize("factory, needle", [
    ("loss_only", "forward(x, y) returned a tensor of shape (); it must return a pair (logits, loss)"),
    ("per_token_loss", "the loss must be a scalar tensor"),
    ("not_a_module", "returned a dict, not a torch.nn.Module"),
    ("no_parameters", "without trainable parameters"),
])
def test_a_model_factory_that_breaks_the_contract(tmp_path, capsys, monkeypatch, factory, needle):
    monkeypatch.syspath_prepend(MODELS)
    run = tmp_path / "run"
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(run), *FAST,
                             "--set", f'model.factory="bad_factories:{factory}"'])
    assert_one_line_error(done, needle)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


@pytest.mark.parametrize("factory, args, needle", [
    ("width_from_args", "{ d_model = 0 }", "parameter(s) with no elements: emb.weight (256, 0)"),
    ("raises_on_bad_args", "{ n_layer = 0 }",
     "failed with model args {'seq_len': 16, 'n_layer': 0}: ValueError: n_layer must be >= 1"),
])
def test_a_model_factory_given_bad_args(tmp_path, capsys, monkeypatch, factory, args, needle):
    monkeypatch.syspath_prepend(MODELS)
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(tmp_path / "run"), *FAST,
                             "--set", f'model.factory="bad_factories:{factory}"', "--set", f"model.args={args}"])
    assert_one_line_error(done, needle)


def test_a_user_error_under_max_restarts_is_not_retried(tmp_path):
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), *FAST, "--max-restarts", "3",
                   "--set", 'model.factory="bad_factories:loss_only"', env={**ENV, "PYTHONPATH": MODELS})
    assert_one_line_error(proc, "it must return a pair (logits, loss)")
    assert proc.stderr.count("error: ") == 1  # the child's line only: no restart, no give-up
    assert not [e for e in events(run, missing_ok=True) if e["event"] in ("restart", "gave_up")]


def test_a_file_named_as_a_token_dataset_is_refused_before_the_run_dir_is_made(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("some text")
    run = tmp_path / "run"
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(run), "--set", f'data.sources=[{{url="{text}"}}]'])
    assert_one_line_error(done, f"data.sources[0].url = '{text}' is a file; a source url must be the folder of a "
                                "dataset made by `harness data prepare` (the folder holding index.json)")
    assert not run.exists()


def test_a_file_named_as_a_token_dataset_under_max_restarts_stops_the_supervisor_and_leaves_nothing(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text")
    run = tmp_path / "run"
    proc = harness("train", str(TINY), "--run-dir", str(run), "--max-restarts", "3",
                   "--set", f'data.sources=[{{url="{text}"}}]')
    assert_one_line_error(proc, f"data.sources[0].url = '{text}' is a file")
    assert proc.stderr.count("error: ") == 1  # the child's line only: no restart, no give-up
    assert not run.exists()


def test_extends_must_be_a_path(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("extends = 5\n")
    done = Finished(capsys, ["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert_one_line_error(done, 'extends = 5: expected the path of another TOML file as a string')


@pytest.mark.parametrize("command", ["train", "sweep", "supervise"])
def test_a_negative_backoff_is_refused(tmp_path, capsys, command):
    run = tmp_path / "run"
    args = {"train": [str(TINY), "--run-dir", str(run)], "sweep": [str(TINY)],
            "supervise": ["--run-dir", str(run), "--", "true"]}[command]
    done = Finished(capsys, [command, "--max-restarts", "2", "--backoff-initial", "-1", *args])
    assert_one_line_error(done, "--max-restarts and --backoff-initial must be >= 0 and --crash-loop-limit >= 1")
    assert not run.exists()


def test_eval_fraction_zero_is_refused_by_validation(tmp_path, capsys):
    run = tmp_path / "run"
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(run), "--set", "data.eval_fraction=0"])
    assert_one_line_error(done, "data.eval_fraction: Input should be greater than 0")
    assert not run.exists()  # refused before the run dir was touched


def test_the_quickstart_model_follows_data_seq_len(tmp_path, capsys):
    run = tmp_path / "run"
    done = Finished(capsys, ["train", str(ROOT / "configs" / "quickstart.toml"), "--run-dir", str(run),
                             "--set", "data.seq_len=256", "--set", "data.batch_size=2", "--set", "train.steps=1",
                             "--set", "train.eval_batches=1", "--set", "train.eval_every=0"])
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["data"]["seq_len"] == 256 and "seq_len" not in config["model"]["args"]


def test_a_model_shorter_than_the_samples_is_a_config_error(tmp_path, capsys):
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(tmp_path / "run"),
                             "--set", "model.args.seq_len=8"])
    assert_one_line_error(done, "model.args.seq_len = 8 is shorter than data.seq_len = 16")


def test_lr_muon_on_another_optimizer_says_which_types_take_it(tmp_path, capsys):
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(tmp_path / "run"),
                             "--set", "optim.type=lion", "--set", "optim.lr_muon=0.02"])
    assert_one_line_error(done, "optim.lr_muon: unknown key for optim.type = 'lion'; it belongs to optim.type = 'muon'")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    harness("train", str(TINY), "--run-dir", str(run), *FAST, check=True)
    return run


def test_report_and_compare_survive_a_nul_tail_and_random_bytes(trained, tmp_path):
    run = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(trained), str(run)], check=True)
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\0" * 4096)  # what a power loss leaves at the end of an appended file
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(os.urandom(2048) + b"\n" + b'[1, 2]\n"text"\n')
    report = harness("report", str(run))
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    assert "last step 2" in report.stdout and "last exit finished" in report.stdout
    compare = harness("compare", str(run))
    assert compare.returncode == 0 and "Traceback" not in compare.stderr, compare.stderr
    assert "| damaged" in compare.stdout


@pytest.mark.parametrize("command", [["report", "{run}"], ["ckpt", "show", "{run}/checkpoints/step-00000002"],
                                     ["ckpt", "ls", "{run}"]])
def test_a_closed_pipe_ends_a_command_quietly(trained, command):
    args = [a.format(run=trained) for a in command]
    # `true` exits without reading: every write to the pipe fails, as after `| head -2` has its lines.
    shell = f'{sys.executable} -m harness.cli {" ".join(args)} | true; exit ${{PIPESTATUS[0]}}'
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141, proc.stderr


def test_log_level_after_the_command_is_accepted_and_debug_adds_records(trained, capsys):
    assert main(["ckpt", "ls", str(trained), "--log-level", "debug"]) == 0
    assert "[debug" in capsys.readouterr().err
    assert main(["ckpt", "ls", str(trained)]) == 0
    assert "[debug" not in capsys.readouterr().err


def test_resume_from_a_missing_checkpoint_says_so(tmp_path, capsys):
    missing = tmp_path / "other" / "checkpoints" / "step-00000004"
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--resume", str(missing)])
    assert_one_line_error(done, "no such checkpoint folder; `harness ckpt ls")
    assert "interrupted save" not in done.stderr


def test_a_memory_run_dir_warns_that_nothing_persists(tmp_path, capsys):
    assert main(["train", str(TINY), "--run-dir", f"memory://{tmp_path.name}", "--set", f'log_dir="{tmp_path}"',
                 *FAST]) == 0
    assert "nothing can resume from them" in capsys.readouterr().err


def test_ckpt_positional_arguments_have_help(capsys):
    for sub in ("ls", "verify", "show", "diff", "gc"):
        with pytest.raises(SystemExit):
            main(["ckpt", sub, "--help"])
        usage = capsys.readouterr().out
        positional = usage[usage.index("positional arguments:"):usage.index("options:")]
        described = [line for line in positional.splitlines()[1:] if line.strip()]
        assert described, usage
        assert all(len(line.split(maxsplit=1)) == 2 or line.startswith(" " * 10) for line in described), usage


def test_a_checkpoint_that_spelled_out_seq_len_resumes_under_a_config_that_derives_it():
    """Configs written before seq_len was derived (model.args.seq_len = data.seq_len) are the same run."""
    from harness.config import config_changes, load_config, public_config

    derived = load_config(TINY)
    spelled = public_config(derived)
    spelled["model"]["args"]["seq_len"] = derived.data.seq_len
    assert not config_changes(spelled, derived)
    spelled["model"]["args"]["seq_len"] = 2 * derived.data.seq_len
    assert list(config_changes(spelled, derived)) == ["model.args.seq_len"]


@pytest.mark.parametrize("command, under, needle", [
    (["ckpt", "consolidate", "{run}/checkpoints/step-00000002", "--out", "{out}"], False,
     "--out {out} is a file, not a folder: give a folder path"),
    (["ckpt", "consolidate", "{run}/checkpoints/step-00000002", "--out", "{out}"], True,
     "cannot write to --out {out}: "),
    (["compare", "{run}", "--plot", "{out}"], True, "cannot write the plot to --plot {out}: "),
    (["data", "prepare", "builtin:corpus", "--out", "{out}", "--tokenizer", "bytes"], False,
     "--out {out} is a file, not a folder"),
    (["data", "prepare", "builtin:corpus", "--out", "{out}", "--tokenizer", "bytes"], True,
     "cannot write to --out {out}: "),
    (["torture", "{out}", "--points", "1"], False, "scratch folder {out} is a file, not a folder: give a folder path"),
])
def test_an_output_path_that_is_a_file_or_unwritable_is_named(trained, tmp_path, capsys, command, under, needle):
    """A file where a folder goes, or a path under a file (unwritable, even as root): the path and
    what to do, not a FileExistsError / NotADirectoryError / PermissionError traceback."""
    a_file = tmp_path / "afile"
    a_file.write_text("mine")
    out = f"{a_file}/sub" if under else str(a_file)
    done = Finished(capsys, [a.format(run=trained, out=out) for a in command])
    assert_one_line_error(done, needle.format(out=out))
    assert a_file.read_text() == "mine"


def test_a_data_factory_with_the_wrong_signature_is_named_as_model_factories_are(tmp_path, capsys):
    done = Finished(capsys, ["train", str(TINY), "--run-dir", str(tmp_path / "run"), *FAST,
                             "--set", 'data.factory="os:getcwd"'])
    assert_one_line_error(done, "data factory 'os:getcwd' failed with data args {}: TypeError: ")


def test_config_errors_name_where_the_bad_key_came_from(tmp_path):
    """A key from --set (or a sweep's --grid) is the command line's, not the file's; a union
    field's members ("every_steps": an integer or "auto") fail as one key; a folder given as the
    config is named as one."""
    from harness.config import load_config
    from harness.errors import UserError

    config = tmp_path / "bad.toml"
    config.write_text(f'extends = "{TINY}"\n[train]\nstepz = 3\n')
    with pytest.raises(UserError) as e:
        load_config(config, ["train.steps=0", 'data.sources=[{url = "x", weight = "a"}]',
                             "checkpoint.every_steps=autox"])
    assert sorted(str(e.value).split("; ")) == sorted([
        "command line: train.steps: Input should be greater than 0",
        "command line: data.sources.0.weight: Input should be a valid number, unable to parse string as a number",
        "command line: checkpoint.every_steps: Input should be a valid integer, unable to parse string as an integer "
        "or Input should be 'auto'",
        f"{config}: train.stepz: unknown key (check the spelling", "see configs/ for the valid keys)"])
    with pytest.raises(UserError, match=f"config file {tmp_path} is a folder"):
        load_config(tmp_path)


def test_target_loss_without_grouped_runs_is_refused_not_dropped(trained, capsys):
    assert_one_line_error(Finished(capsys, ["compare", str(trained), "--target-loss", "4.0"]),
                          "--target-loss applies to grouped runs")


@pytest.mark.parametrize("command", [["compare"], ["report"], ["status"], ["status", "--watch", "1"]])
def test_a_file_given_as_a_run_dir_is_named(tmp_path, capsys, command):
    a_file = tmp_path / "afile"
    a_file.write_text("mine")
    done = Finished(capsys, [command[0], str(a_file), *command[1:]])
    assert_one_line_error(done, f"{a_file} is a file, not a run dir: pass the folder given to `harness train`")
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("command", ["report", "compare", "status"])
def test_a_run_dir_that_does_not_exist_is_named_and_not_made(tmp_path, capsys, command):
    missing = tmp_path / "no-such-run"
    assert_one_line_error(Finished(capsys, [command, str(missing)]), str(missing))
    assert not missing.exists()
