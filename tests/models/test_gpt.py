"""The GPT: parameter names, bitwise determinism with dropout, and that it learns the corpus."""

from __future__ import annotations

import time

import pytest
import torch

from harness.data import BatchStream, TokenDataset
from harness.errors import UserError
from harness.models import DEFAULT_FACTORY, GPTConfig, build_gpt, load_factory


def seeded_gpt(seed: int = 0, **args) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_gpt(args)


def test_parameter_names_and_untied_head():
    model = seeded_gpt(n_layer=2)
    names = set(dict(model.named_parameters()))
    expected = {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    for i in range(2):
        expected |= {
            f"blocks.{i}.ln1.weight", f"blocks.{i}.ln1.bias", f"blocks.{i}.attn.qkv.weight",
            f"blocks.{i}.attn.proj.weight", f"blocks.{i}.ln2.weight", f"blocks.{i}.ln2.bias",
            f"blocks.{i}.mlp.fc.weight", f"blocks.{i}.mlp.proj.weight",
        }
    assert names == expected
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()


def test_config_rejects_unknown_and_inconsistent_args():
    with pytest.raises(UserError, match="n_layers.*known: vocab_size"):
        build_gpt({"n_layers": 3})
    with pytest.raises(UserError, match="n_head"):
        build_gpt({"n_head": 3, "d_model": 64})
    assert all(field.description for field in GPTConfig.model_fields.values())


def test_same_seed_same_weights():
    a, b, c = seeded_gpt(1), seeded_gpt(1), seeded_gpt(2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.head.weight, c.head.weight)


def forward_backward(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = seeded_gpt(0, dropout=0.2)
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(seed)
    logits, loss = model(x, x.roll(-1, dims=1))
    loss.backward()
    return logits, [p.grad for p in model.parameters()]


def test_forward_backward_with_dropout_is_bitwise_repeatable():
    logits_a, grads_a = forward_backward(seed=11)
    logits_b, grads_b = forward_backward(seed=11)
    logits_c, _ = forward_backward(seed=12)
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(ga, gb) for ga, gb in zip(grads_a, grads_b, strict=True))
    # Dropout is really on: another RNG state gives other masks.
    assert not torch.equal(logits_a, logits_c)


def test_eval_mode_has_no_dropout():
    model = seeded_gpt(dropout=0.5).eval()
    x = torch.zeros(1, 8, dtype=torch.long)
    assert torch.equal(model(x)[0], model(x)[0])


def test_too_long_input_is_refused():
    with pytest.raises(ValueError, match="seq_len=64"):
        seeded_gpt()(torch.zeros(1, 65, dtype=torch.long))


def test_loss_falls_on_the_default_corpus():
    start = time.perf_counter()
    model = seeded_gpt(0, seq_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stream = BatchStream(TokenDataset.from_url(None, seq_len=32), batch_size=16, seed=0)
    losses = []
    for _ in range(100):
        batch = next(stream)
        _, loss = model(batch.x, batch.y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Untrained, the loss is about ln(256) = 5.55; the corpus's spelling and grammar take it
    # below 2.2 nats within 100 steps.
    last = sum(losses[-10:]) / 10
    assert losses[0] > 5.3 and last < 2.2, (losses[0], last)
    assert time.perf_counter() - start < 10


def test_load_factory_resolves_import_paths():
    assert load_factory(DEFAULT_FACTORY) is build_gpt
    assert load_factory("harness.models:GPTConfig.model_validate")({}).n_layer == 2


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("harness.models.gpt", "not of the form"),
        ("harness.no_such_module:build", "cannot import module 'harness.no_such_module'"),
        ("harness.models.gpt:build_bert", "has no attribute 'build_bert'"),
        ("harness.models:DEFAULT_FACTORY", "is a str, not a callable"),
    ],
)
def test_load_factory_explains_bad_paths(path, message):
    with pytest.raises(UserError, match=message):
        load_factory(path)
