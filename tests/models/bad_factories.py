"""Model factories that break the contract of docs/models.md, one way each (tests/cli/test_user_errors.py)."""

from torch import nn
from torch.nn import functional as F


class _LossOnly(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.emb = nn.Embedding(256, args.get("d_model", 8))
        self.out = nn.Linear(args.get("d_model", 8), 256)

    def forward(self, x, y=None):
        logits = self.out(self.emb(x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())  # the contract: (logits, loss)


def loss_only(args):
    return _LossOnly(args)


def per_token_loss(args):
    """forward returns (logits, a loss per token): not a scalar."""
    model = _LossOnly(args)

    def forward(x, y=None):
        logits = model.out(model.emb(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")

    model.forward = forward
    return model


def not_a_module(args):
    return {"model": _LossOnly(args)}


def no_parameters(args):
    return nn.Identity()


def width_from_args(args):
    """A width taken from model.args: d_model = 0 gives empty parameters."""
    return _LossOnly({"d_model": args["d_model"]})


def raises_on_bad_args(args):
    if args.get("n_layer", 1) < 1:
        raise ValueError(f"n_layer must be >= 1, got {args['n_layer']}")
    return _LossOnly(args)
