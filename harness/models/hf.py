"""The built-in factory for `transformers` causal LMs: `model.factory = "harness.models.hf:causal_lm"`.

`model.args` says where the model's config comes from, one of:
- `config = "path/to/config.json"` (or the folder holding it): a `transformers` config file;
- `model_type = "llama"` and the config's fields inline (`hidden_size = 64`, ...);
- `pretrained = "path/to/folder"`: a saved model (`save_pretrained`, `harness ckpt export`),
  its config and its weights, loaded with `from_pretrained` every time the model is built (a
  resume then replaces them with the checkpoint's). `model.init_from` loads weights at step 0
  only and records their digests (docs/models.md).
Every other key of `model.args` is a config field that overrides the file's (`dropout`-like
fields, `num_hidden_layers`), checked against the config class's own fields: a misspelt one is
an error, never an attribute transformers would silently keep. Two keys are the data's, not
fields: `seq_len` (data.seq_len) must fit the config's `max_position_embeddings` where it has
one; `vocab_size` is a field inline, and with a config file or a pretrained folder it is the
vocabulary the data needs, which the file's must cover (the model keeps the file's). Paths are
local files only: nothing is downloaded from the Hugging Face hub. `attn_implementation` is
"sdpa" (the default) or "eager"; both are deterministic on a CPU and resume bitwise, and sdpa
is what `from_pretrained` picks for an exported folder too, so that computes the same logits.

The module is the `transformers` class itself (a subclass of e.g. `LlamaForCausalLM` with the
same name), so its parameter names, state dict and checkpoints are transformers' own
(`model.layers.0.self_attn.q_proj.weight`), with two additions: `forward(x, y)` is the
harness's contract (docs/models.md: input ids and next-token ids -> (logits, mean cross
entropy)), and `matrix_patterns` names the decoder layers' parameters (the ModuleLists of the
class's `_no_split_modules` layers: `model.layers.*`, `transformer.h.*`), which the matrix
optimizers take by default (their 2-D weights: attention and MLP projections; embeddings,
norms and the LM head stay with AdamW). Weights are initialised by transformers from the global
torch RNG (fixed by train.seed), dropout draws from it too: the harness saves it.

`transformers` is an optional extra (`pip install -e '.[hf]'`), imported only when used.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.errors import UserError

FACTORY = "harness.models.hf:causal_lm"
ATTENTION = ("sdpa", "eager")
CONFIG_FILE = "config.json"
HF_CONFIG_META = "hf_config"  # a checkpoint's meta: the model's config.json (HarnessForward.hf_config)
_SOURCES = ("config", "pretrained", "model_type")
_NOT_FIELDS = {"seq_len", "attn_implementation", "config", "pretrained"}


def import_transformers() -> Any:
    """The `transformers` module; a one-line UserError saying how to install it when it is missing."""
    try:
        import transformers
    except ImportError:
        raise UserError("this needs the `transformers` package, which is not installed: "
                        "pip install -e '.[hf]' (or pip install transformers)") from None
    return transformers


def causal_lm(args: dict[str, Any]) -> nn.Module:
    """The model factory (module docstring): a `transformers` causal LM meeting the harness's
    forward contract, built from `args` (model.args plus seq_len, and the data's vocab_size
    when it has one)."""
    transformers = import_transformers()
    sources = [k for k in _SOURCES if k in args]
    if len(sources) != 1:
        given = f"{' and '.join(sources)} are set" if sources else "none is set"
        raise UserError(f"model.args for {FACTORY}: set one of config (a config.json), pretrained (a saved model "
                        f"folder) or model_type (plus the config's fields inline); {given}")
    attention = args.get("attn_implementation", "sdpa")
    if attention not in ATTENTION:
        raise UserError(f"model.args.attn_implementation = {attention!r}: use one of {', '.join(ATTENTION)} "
                        "(deterministic on a CPU, so a resume is bitwise)")
    fields = {k: v for k, v in args.items() if k not in _NOT_FIELDS}
    if "pretrained" in args:
        folder = local_path(args["pretrained"], "model.args.pretrained", folder=True)
        path = folder / CONFIG_FILE
        doc, where = read_config(path, "model.args.pretrained"), f"model.args.pretrained: {path}"
    elif "config" in args:
        path = local_path(args["config"], "model.args.config")
        path = path / CONFIG_FILE if path.is_dir() else path
        doc, where = read_config(path, "model.args.config"), f"model.args.config: {path}"
    else:
        doc, where = {"model_type": fields.pop("model_type")}, "model.args"
    # A file's vocabulary stands (a pretrained model's embeddings are its size): the data's must fit in it.
    needed_vocab = fields.pop("vocab_size", None) if "model_type" not in args else None
    config = build_config(transformers, doc, fields, where)
    check_fits(config, args.get("seq_len"), needed_vocab)
    cls = harness_class(causal_lm_class(transformers, config))
    if "pretrained" in args:
        model = cls.from_pretrained(folder, config=config, local_files_only=True, attn_implementation=attention,
                                    dtype=torch.float32)
    else:
        model = cls._from_config(config, attn_implementation=attention, dtype=torch.float32)
    model.matrix_patterns = decoder_layer_patterns(model)
    return model


def local_path(value: Any, setting: str, folder: bool = False) -> Path:
    """`value` as an existing local path; a UserError naming `setting` otherwise, which says that
    a hub id is not downloaded when `value` looks like one."""
    if not isinstance(value, str) or not value:
        raise UserError(f"{setting} = {value!r}: expected a path (a string)")
    path = Path(value).expanduser()
    if not path.exists():
        hub = (" It looks like a Hugging Face hub id: the harness reads local files only and downloads nothing; "
               f"download it first (huggingface-cli download {value} --local-dir DIR) and give DIR"
               if value.count("/") == 1 and not value.startswith((".", "/", "~")) else "")
        raise UserError(f"{setting} = {value!r}: no such {'folder' if folder else 'file or folder'}.{hub}")
    if folder and not path.is_dir():
        raise UserError(f"{setting} = {value!r} is a file; give the folder holding config.json and the weights")
    return path


def read_config(path: Path, setting: str) -> dict[str, Any]:
    """The JSON object in the config file at `path`; UserError when there is none there, it is
    not JSON, or it names no `model_type`."""
    if not path.is_file():
        raise UserError(f"{setting}: {path} does not exist; a saved model folder holds config.json")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{setting}: {path} is not a JSON config transformers can read ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise UserError(f"{setting}: {path} has no \"model_type\"; transformers cannot tell which model it "
                        "configures (a config.json written by save_pretrained has one)")
    return doc


def build_config(transformers: Any, doc: dict[str, Any], fields: dict[str, Any], where: str) -> Any:
    """The config of `doc`'s `model_type` from `doc` with `fields` over it, in one construction
    (a config derives fields in its constructor: Llama's head_dim from hidden_size). A field
    the config class neither has nor takes is refused: transformers would keep it as a stray
    attribute that configures nothing. `where` names the source in messages."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = doc["model_type"]
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UserError(f"{where}: model_type {model_type!r} is not one transformers {transformers.__version__} knows; "
                        "use a causal LM's, e.g. llama, qwen2, mistral, gpt2 (transformers' "
                        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES lists them all)")
    config_class = CONFIG_MAPPING[model_type]
    values = {k: v for k, v in doc.items() if k != "model_type"}
    try:
        config = config_class.from_dict({**values, **fields})
    except Exception as e:  # transformers validates fields in its own ways (ValueError, TypeError, ...)
        raise UserError(f"{where}: transformers cannot build a {config_class.__name__} from it "
                        f"({type(e).__name__}: {' '.join(str(e).split())})") from None
    # What the config neither has as a field nor consumed (as Llama's rope_theta goes into rope_parameters).
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    stray = sorted(k for k in fields if k not in known and k in vars(config))
    if stray:
        listed = sorted(k for k in known if not k.startswith("_"))
        raise UserError(f"model.args: {', '.join(stray)} {'is not a field' if len(stray) == 1 else 'are not fields'} "
                        f"of transformers' {config_class.__name__}; check the spelling (its fields: "
                        f"{', '.join(listed[:40])}{', ...' if len(listed) > 40 else ''})")
    return config


def check_fits(config: Any, seq_len: Any, vocab_size: Any) -> None:
    """Refuse a config whose position table is shorter than data.seq_len, or whose vocabulary is
    smaller than the data's."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(seq_len, int) and isinstance(positions, int) and positions < seq_len:
        raise UserError(f"the model's max_position_embeddings = {positions} is shorter than data.seq_len = {seq_len}: "
                        "lower data.seq_len or raise max_position_embeddings (n_positions for GPT-2) in model.args")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size > config.vocab_size):
        raise UserError(f"the model's vocab_size = {config.vocab_size} does not cover the data's vocabulary "
                        f"({vocab_size} ids): use a config whose vocabulary holds the data's tokenizer")


def causal_lm_class(transformers: Any, config: Any) -> type:
    """The `...ForCausalLM` class transformers maps `config`'s type to."""
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return mapping[type(config)]
    except KeyError:
        raise UserError(f"transformers has no causal LM for model_type {config.model_type!r} (no "
                        "AutoModelForCausalLM class); choose a decoder model type such as llama, qwen2, gpt2") from None


@functools.cache
def harness_class(base: type) -> type[Any]:  # a transformers class (loaded lazily: Any)
    """`base` (a transformers `...ForCausalLM`) with the harness's forward, under `base`'s own
    name, so `save_pretrained` of it writes `architectures = [base name]`."""
    return type(base.__name__, (HarnessForward, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__})


class HarnessForward(nn.Module):
    """The harness's forward contract over a transformers causal LM (mixed in before it)."""

    matrix_patterns: list[str]
    config: Any  # the transformers PretrainedConfig the model mixed into sets

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, mean cross entropy of the logits against `y`): `y` already holds each
        position's next token, so no shift here (transformers' `labels` would shift again). The
        loss is taken in float32, as transformers' own causal LM loss does."""
        logits = super().forward(input_ids=x, use_cache=False).logits
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def hf_config(self) -> dict[str, Any]:
        """config.json of this model as JSON data, `architectures` naming its transformers class
        (recorded in every checkpoint's meta: what `harness ckpt export --format hf` writes)."""
        doc = json.loads(self.config.to_json_string(use_diff=False))
        # The class that mixed this in (FSDP2 subclasses it again, under another name).
        doc["architectures"] = [next(c for c in type(self).__mro__ if HarnessForward in c.__bases__).__name__]
        return doc


def decoder_layer_patterns(model: nn.Module) -> list[str]:
    """fnmatch patterns of the parameters of `model`'s decoder layers: each ModuleList whose items
    are the classes transformers names in `_no_split_modules` (its repeated layer), else each
    ModuleList of `num_hidden_layers` items."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    found = [name for name, m in lists if all(type(c).__name__ in layer_classes for c in m)]
    if not found:
        layers = getattr(model.config, "num_hidden_layers", None)
        found = [name for name, m in lists if len(m) == layers]
    return [f"{name}.*" for name in found]
