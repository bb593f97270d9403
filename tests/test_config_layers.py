"""Config files and command-line overrides layered (harness/config_layers.py): `unset` in a file
and `--set KEY=null` remove an inherited key, and an error names the file a key came from, or
the command line. In-process: no training."""

import pytest

from harness.config import batch_shape, load_config
from harness.errors import UserError
from procs import ROOT, TINY

CONFIGS = ROOT / "configs"


def write(path, text):
    path.write_text(text)
    return path


def test_the_token_example_splits_its_global_batch_over_1_2_and_4_ranks():
    cfg = load_config(CONFIGS / "tokens-example.toml")
    assert [batch_shape(cfg, world) for world in (1, 2, 4)] == [(16, 1), (8, 1), (4, 1)]
    quickstart = load_config(CONFIGS / "quickstart.toml")
    assert (cfg.data.batch_size, cfg.train.grad_accum) == batch_shape(quickstart, 1)  # one rank: the quickstart's batch


def test_unset_in_a_file_removes_an_inherited_key_so_it_is_derived(tmp_path):
    child = write(tmp_path / "child.toml", f'extends = "{TINY}"\nunset = ["train.grad_accum"]\n'
                                          "[train]\nglobal_batch = 16\n")
    cfg = load_config(child)  # tiny sets batch_size 4 and grad_accum 2
    assert [batch_shape(cfg, world) for world in (1, 2, 4)] == [(4, 4), (4, 2), (4, 1)]
    with pytest.raises(UserError, match="the valid world sizes for this config are 2:"):
        batch_shape(load_config(TINY, ["train.global_batch=16"]), 1)


def test_set_null_unsets_a_key_and_a_quoted_null_is_a_string(tmp_path):
    cfg = load_config(TINY, ["train.global_batch=16", "train.grad_accum=null"])
    assert "grad_accum" not in cfg.train.model_fields_set and batch_shape(cfg, 2) == (4, 2)
    assert load_config(TINY, ["train.grad_accum=7", "train.grad_accum=null"]).train.grad_accum == 1  # the default
    assert load_config(TINY, ['run_dir="null"']).run_dir == "null"


def test_unsetting_a_table_replaces_it_instead_of_merging(tmp_path):
    child = write(tmp_path / "child.toml", f'extends = "{TINY}"\nunset = ["model.args"]\n[model.args]\nn_layer = 2\n')
    assert load_config(child).model.args == {"n_layer": 2}


@pytest.mark.parametrize("text, overrides, needle", [
    ('unset = ["train.grad_acum"]\n', [],
     "unset 'train.grad_acum': train.grad_acum is not set by {tiny} (with what it extends), "
     "so there is nothing to unset"),
    ('unset = ["train.grad_accum"]\n[train]\ngrad_accum = 3\n', [],
     "unset lists train.grad_accum and the file sets it too; remove one of them"),
    ('unset = "train.grad_accum"\n', [], "expected a list of dotted keys"),
    ("", ["train.global_batch=null"],
     "--set train.global_batch=null: train.global_batch is not set by {child} (with what it extends) "
     "or an earlier --set"),
])
def test_an_unset_that_does_nothing_is_refused(tmp_path, text, overrides, needle):
    child = write(tmp_path / "child.toml", f'extends = "{TINY}"\n{text}')
    with pytest.raises(UserError) as e:
        load_config(child, overrides)
    assert needle.format(tiny=TINY, child=child) in str(e.value)


def test_unset_without_extends_is_refused(tmp_path):
    config = write(tmp_path / "alone.toml", 'unset = ["train.grad_accum"]\n')
    with pytest.raises(UserError, match="alone.toml: unset removes keys an extended file sets, but .* extends none"):
        load_config(config)


def test_a_missing_base_names_the_file_that_extends_it(tmp_path):
    child = write(tmp_path / "child.toml", 'extends = "nope.toml"\n')
    with pytest.raises(UserError) as e:
        load_config(child)
    assert str(e.value) == (f'{child}: extends = "nope.toml": {tmp_path / "nope.toml"} does not exist; fix the path '
                            "(it is relative to the extending file)")


def test_an_inherited_bad_key_is_blamed_on_the_file_it_came_from(tmp_path):
    base = write(tmp_path / "base.toml", '[train]\nsteps = "many"\n')
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[train]\nseed = 1\n[data]\nseq_len = 0\n')
    with pytest.raises(UserError) as e:
        load_config(child)
    assert sorted(str(e.value).split("; ")) == [
        f"{base}: train.steps: Input should be a valid integer, unable to parse string as an integer",
        f"{child}: data.seq_len: Input should be greater than 0"]
    with pytest.raises(UserError) as e:
        load_config(child, ["train.steps=3", "data.seq_len=0"])
    assert str(e.value) == "command line: data.seq_len: Input should be greater than 0"


def test_an_unknown_optimizer_type_from_the_command_line_is_the_command_lines(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(CONFIGS / "quickstart.toml", ["optim.type=adam"])
    assert str(e.value).startswith("command line: optim.type: unknown type 'adam'; expected one of 'adamw', 'muon'")
    child = write(tmp_path / "child.toml", f'extends = "{CONFIGS / "quickstart.toml"}"\n[optim]\ntype = "adam"\n')
    with pytest.raises(UserError, match=f"^{child}: optim.type: unknown type 'adam'"):
        load_config(child)


def test_a_table_replaced_on_the_command_line_is_the_command_lines_and_a_key_set_into_it_its_own(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(TINY, ["train={steps = 0}", "train.seed=2"])
    assert str(e.value) == "command line: train.steps: Input should be greater than 0"
    child = write(tmp_path / "child.toml", f'extends = "{TINY}"\n[data]\nbatch_size = 0\n')
    with pytest.raises(UserError) as e:
        load_config(child, ['data={seq_len = 0, batch_size = 2}'])  # the file's batch_size is gone
    assert str(e.value) == "command line: data.seq_len: Input should be greater than 0"
