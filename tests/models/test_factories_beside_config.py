"""A factory's module beside its config file is found without PYTHONPATH (harness/models:
load_factory, the folder from harness/config/section.py's CodeSection): task.factory,
model.factory and data.factory alike, whatever the working folder."""

from __future__ import annotations

import shutil

import pytest

from harness.config import load_config
from harness.errors import UserError
from harness.models import load_factory
from procs import ENV, ROOT, TINY, harness

NO_PATH = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
SHORT = ["--set", "train.steps=2", "--set", "checkpoint.every_steps=2", "--set", "train.eval_batches=1"]


def beside_task(folder):
    shutil.copy(ROOT / "examples" / "image_classifier.py", folder / "beside_task.py")
    return (f'extends = "{ROOT / "examples" / "image_classifier.toml"}"\n'
            '[task]\nfactory = "beside_task:build"\nargs = { width = 4, train_samples = 128, eval_samples = 16 }\n')


def beside_model(folder):
    (folder / "beside_model.py").write_text("from harness.models.gpt import build_gpt\n\n\n"
                                            "def build(args):\n    return build_gpt(args)\n")
    return f'extends = "{TINY}"\n[model]\nfactory = "beside_model:build"\n'


def beside_data(folder):
    shutil.copy(ROOT / "tests" / "data" / "user_datasets.py", folder / "beside_data.py")
    return f'extends = "{TINY}"\n[data]\nfactory = "beside_data:build"\nargs = {{ train = 64 }}\n'


@pytest.mark.parametrize("write", [beside_task, beside_model, beside_data], ids=["task", "model", "data"])
def test_a_factory_module_beside_its_config_trains_from_another_folder(tmp_path, write):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "run.toml").write_text(write(folder))
    run = tmp_path / "run"
    # The working folder is the repository's, the module is in `folder`, and nothing is on PYTHONPATH.
    proc = harness("train", str(folder / "run.toml"), "--run-dir", str(run), *SHORT, env=NO_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step-00000002" / "manifest.json").exists()


def test_the_folder_is_that_of_the_file_that_named_the_factory(tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    (tmp_path / "exp").mkdir()
    (tmp_path / "base" / "base.toml").write_text('[data]\nfactory = "my_data:build"\n')
    (tmp_path / "exp" / "run.toml").write_text('extends = "../base/base.toml"\n[train]\nsteps = 3\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config("exp/run.toml", ['model.factory="my_model:build"'])
    assert cfg.data.code_folder == tmp_path / "base"  # absolute: the working folder may change later
    assert cfg.model.code_folder == tmp_path / "exp"  # --set: the config file named on the command line


def test_a_module_found_nowhere_names_the_folder_searched(tmp_path):
    with pytest.raises(UserError, match=f"check the spelling and that the module is beside the config file "
                                        f"\\(in {tmp_path}\\), installed or on PYTHONPATH"):
        load_factory("nowhere_to_be_found:build", "task factory", folder=tmp_path)
