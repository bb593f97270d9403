"""transformers causal LMs through `model.factory = "harness.models.hf:causal_lm"` (docs/models.md,
"Hugging Face models"): bitwise resume after real kills, the matrix optimizers' default split,
`model.init_from` at step 0 only, `harness ckpt export --format hf` opened by `from_pretrained`
with the harness model's logits, and the bad inputs (one line, exit 2). Tiny configs, random
init, nothing downloaded. The FSDP arm: tests/distributed/test_fsdp_hf.py."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from harness.cli import main
from harness.config import load_config, model_args
from harness.data import BatchStream
from harness.data.sources import open_data
from harness.models.contract import build_model
from harness.models.hf import causal_lm
from harness.models.init_from import load_initial_weights
from optim.build import build_bundle
from optim.config import parse_optim_config
from procs import (
    ENV,
    ROOT,
    TINY,
    assert_one_line_error,
    assert_same_run,
    final_checkpoint,
    harness,
    kill_at_step,
    losses,
)
from shard_data import make_sources

DATA = Path(__file__).parent / "data"
HF_LLAMA, HF_GPT2 = DATA / "hf-llama.toml", DATA / "hf-gpt2.toml"
CONFIGS = {"llama": HF_LLAMA, "gpt2": HF_GPT2}
STEPS = 12


class Finished:
    """What `main(argv)` left: its exit code and stderr."""

    def __init__(self, capsys, argv):
        self.returncode = main(argv)
        self.stderr = capsys.readouterr().err


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def verified(request, tmp_path_factory):
    """(name, config, verify-resume's work dir, its output): the continuous run and the one
    SIGKILLed after step 6 and resumed, through `harness verify-resume`."""
    work = tmp_path_factory.mktemp(f"verify-{request.param}")
    done = harness("verify-resume", str(CONFIGS[request.param]), "--interrupt-at", "6", "--signal", "KILL",
                   "--work-dir", str(work))
    return request.param, CONFIGS[request.param], work, done


def test_kill_and_resume_is_identical(verified):
    name, _, work, done = verified
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "resumed from 4 -> finished (exit 0)" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("identical: 12 steps"), done.stdout
    # The checkpoint's names are transformers' own: no wrapper prefix.
    stored = set(load_file(str(final_checkpoint(work / "continuous", STEPS) / "model.safetensors")))
    first = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}[name]
    assert first in stored and all(n.startswith(("model.", "transformer.", "lm_head.")) for n in stored), stored


def harness_model(config: Path, ckpt: Path, tmp_path: Path, capsys) -> torch.nn.Module:
    """The model the harness trains, built by its factory, holding the checkpoint's weights as
    `ckpt consolidate` writes them (every state-dict name, tied ones too: load_state_dict's)."""
    assert main(["ckpt", "consolidate", str(ckpt), "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    cfg = load_config(config)
    model = build_model(cfg.model.factory, model_args(cfg))
    model.load_state_dict(load_file(str(tmp_path / "whole" / "model.safetensors")))
    return model.eval()


def test_export_opens_with_from_pretrained_and_gives_the_harness_logits(verified, tmp_path, capsys, tmpfs):
    name, config, work, _ = verified
    ckpt = final_checkpoint(work / "continuous", STEPS)
    model = harness_model(config, ckpt, tmp_path, capsys)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(x, x.roll(-1, 1))[0]

    def exported(out: Path, *flags: str) -> torch.nn.Module:
        assert main(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(out), *flags]) == 0
        said = capsys.readouterr().out
        assert "no tokenizer written: the run trained on byte-level text" in said, said
        return AutoModelForCausalLM.from_pretrained(str(out)).eval()

    whole = exported(tmp_path / "hf")
    again = Finished(capsys, ["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert_one_line_error(again, "is not empty; give a new or empty folder")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json",
                                                                  "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [type(whole).__name__]
    with torch.no_grad():
        assert torch.equal(whole(x).logits, expected), name  # bitwise in fp32
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    if name == "gpt2":  # the tied head is stored once, under the embedding's name (as save_pretrained does)
        assert "lm_head.weight" not in stored and whole.lm_head.weight is whole.transformer.wte.weight

    sharded = exported(tmp_path / "sharded", "--max-shard-size", "40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    assert sorted(index["weight_map"]) == sorted(stored)
    with torch.no_grad():
        assert torch.equal(sharded(x).logits, expected)

    exported(tmp_path / "bf16", "--dtype", "bfloat16")
    halved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(torch.equal(halved[k], t.to(torch.bfloat16)) for k, t in stored.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # model.init_from reads the sharded folder (its index) and the bf16 one (converted), tied heads once.
    for folder, dtype in ((tmp_path / "sharded", torch.float32), (tmp_path / "bf16", torch.bfloat16)):
        fresh = causal_lm(model_args(load_config(config)))
        record = load_initial_weights(fresh, str(folder))
        listed = sorted(f["name"] for f in record["files"])
        assert listed == (files if dtype == torch.float32 else ["model.safetensors"])
        for name, t in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], t.to(dtype).float()), name

    full = tmpfs(64)  # a real full disk part-way through the weights
    done = Finished(capsys, ["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(full / "hf")])
    assert_one_line_error(done, "cannot write the export to --out")
    assert not any((full / "hf").iterdir())


def test_matrix_optimizers_take_the_decoder_layers_unless_the_config_says_otherwise():
    for config in CONFIGS.values():
        cfg = load_config(config)
        model = causal_lm(model_args(cfg))
        optim, _ = build_bundle(parse_optim_config({"type": "muon"}), model, total_steps=10)
        muon = set(optim.optimizers["muon"].param_groups[0]["param_names"])
        layers = "model.layers." if "llama" in config.name else "transformer.h."
        assert muon == {n for n, p in model.named_parameters() if n.startswith(layers) and p.ndim == 2}, muon
        assert not any("embed" in n or "wte" in n or "wpe" in n or "lm_head" in n or "norm" in n or "ln_" in n
                       for n in muon)
        own = parse_optim_config({"type": "muon", "matrix_patterns": [f"{layers}0.*"]})
        optim, _ = build_bundle(own, model, total_steps=10)
        assert all(n.startswith(f"{layers}0.") for n in optim.optimizers["muon"].param_groups[0]["param_names"])


def saved_llama(folder: Path, seed: int) -> Path:
    """A Llama of hf-llama.toml's shape saved by transformers itself (another init than the run's)."""
    args = {k: v for k, v in load_config(HF_LLAMA).model.args.items() if k != "model_type"}
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**args)).save_pretrained(str(folder))
    return folder


def first_batch_loss(folder: Path, overrides: list[str]) -> float:
    """The loss `from_pretrained(folder)` gives on the run's first batch (no dropout, no accumulation)."""
    cfg = load_config(HF_LLAMA, overrides)
    stream = BatchStream(open_data(cfg.data, cfg.train.seed).train, cfg.data.batch_size, cfg.train.seed)
    try:
        batch = next(stream)
    finally:
        stream.close()
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()  # the run has no dropout
    with torch.no_grad():
        logits = model(batch.x).logits
    return float(F.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten()))


def test_init_from_loads_at_step_0_only_and_resumes_bitwise_and_pretrained_loads_the_same(tmp_path):
    folder = saved_llama(tmp_path / "pretrained", seed=123)
    weights = (folder / "model.safetensors").read_bytes()
    sets = ["model.args.attention_dropout=0.0", "train.grad_accum=1", f"model.init_from='{folder}'"]
    flags = [arg for item in sets for arg in ("--set", item)]
    continuous, interrupted = tmp_path / "continuous", tmp_path / "interrupted"
    harness("train", str(HF_LLAMA), "--run-dir", str(continuous), *flags, check=True)
    assert losses(continuous)[1] == first_batch_loss(folder, sets)
    record = json.loads((continuous / "run.json").read_text())["init_from"]
    assert record == {"url": str(folder), "files": [{"name": "model.safetensors", "bytes": len(weights),
                                                     "sha256": hashlib.sha256(weights).hexdigest()}]}

    # `pretrained` loads the same weights through from_pretrained itself (a field overridden beside it).
    pretrained = tmp_path / "pretrained-run"
    harness("train", str(HF_LLAMA), "--run-dir", str(pretrained), "--set", "train.steps=1", "--set", sets[1],
            "--set", f"model.args={{ pretrained = '{folder}', attention_dropout = 0.0 }}", check=True)
    assert losses(pretrained)[1] == losses(continuous)[1]

    args = ["train", str(HF_LLAMA), "--run-dir", str(interrupted), *flags]
    assert kill_at_step(args, interrupted, 6, signal.SIGKILL) == -signal.SIGKILL
    folder.rename(tmp_path / "gone")  # a resume must not need them
    harness(*args, check=True)
    assert_same_run(continuous, interrupted, STEPS)
    assert json.loads((interrupted / "run.json").read_text())["init_from"] == record  # kept, not re-read

    other = saved_llama(tmp_path / "other", seed=7)
    refused = harness(*args, "--set", f"model.init_from='{other}'")
    assert_one_line_error(refused, "model.init_from differ from the checkpoint")


def test_exported_tokenizer_is_the_datasets(tmp_path, capsys):
    source, _ = make_sources(tmp_path)
    run = tmp_path / "run"
    sources = f'data.sources=[{{url = "{source}"}}]'
    assert main(["train", str(HF_GPT2), "--run-dir", str(run), "--set", sources, "--set", "model.args.vocab_size=257",
                 "--set", "train.steps=2", "--set", "debug.step_sleep_s=0"]) == 0
    assert main(["ckpt", "export", str(final_checkpoint(run, 2)), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "no tokenizer" not in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (Path(source) / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer("hi there")["input_ids"] == list(b"hi there")
    assert tokenizer.eos_token_id == 256  # the dataset's end-of-document token


def stray_tensor(tmp_path: Path) -> Path:
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    return tmp_path / "stray.safetensors"


def bad_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return f"model.args={{ config = '{path}' }}"


@pytest.mark.parametrize("setting, needle", [
    (lambda tmp: bad_config(tmp, "{ not json"), "is not a JSON config transformers can read"),
    (lambda tmp: bad_config(tmp, '{"model_type": "llama", "hidden_size": "big"}'),
     "transformers cannot build a LlamaConfig from it (StrictDataclassFieldValidationError"),
    (lambda tmp: bad_config(tmp, '{"model_type": "no-such-model"}'),
     "model_type 'no-such-model' is not one transformers"),
    (lambda tmp: f"model.args={{ pretrained = '{tmp / 'missing'}' }}", "model.args.pretrained = "),
    (lambda tmp: "model.args={ pretrained = 'meta-llama/Llama-3.2-1B' }",
     "the harness reads local files only and downloads nothing"),
    (lambda tmp: f"model.init_from='{tmp / 'missing.safetensors'}'", "no such file or folder"),
    (lambda tmp: f"model.init_from='{stray_tensor(tmp)}'", "holds 1 tensor(s) the model does not have: stray.weight"),
])
def test_bad_model_input_is_one_line(tmp_path, capsys, setting, needle):
    run = tmp_path / "run"
    done = Finished(capsys, ["train", str(HF_LLAMA), "--run-dir", str(run), "--set", setting(tmp_path)])
    assert_one_line_error(done, needle)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_bad_export_input_is_one_line(tmp_path, capsys):
    gpt = tmp_path / "gpt"
    assert main(["train", str(TINY), "--run-dir", str(gpt), "--set", "train.steps=1",
                 "--set", "debug.step_sleep_s=0"]) == 0
    capsys.readouterr()
    ckpt = str(final_checkpoint(gpt, 1))
    out = tmp_path / "out"
    done = Finished(capsys, ["ckpt", "export", ckpt, "--format", "hf", "--out", str(out)])
    assert_one_line_error(done, "is not a transformers model, so there is no config.json to export")
    assert not out.exists() or not any(out.iterdir())
    done = Finished(capsys, ["ckpt", "export", str(gpt), "--format", "hf", "--out", str(out)])
    assert_one_line_error(done, "is a run dir, not a checkpoint")


def test_without_transformers_the_error_says_to_install_the_extra(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "transformers").mkdir(parents=True)
    (shadow / "transformers" / "__init__.py").write_text("raise ImportError(\"No module named 'transformers'\")\n")
    done = harness("train", str(HF_LLAMA), "--run-dir", str(tmp_path / "run"),
                   env={**ENV, "PYTHONPATH": f"{shadow}:{ROOT}"})
    assert_one_line_error(done, "pip install -e '.[hf]'")
