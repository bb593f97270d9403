"""Run under torchrun (world size 2) by test_ddp.py: the collectives of harness.parallel.distributed, and
Muon under DDP: the orthogonalisation runs after the gradient all-reduce, so every rank applies
the same update (parameters bitwise equal across ranks), and that update is the one a single
process computes on the same global batch (equal up to float rounding)."""

import sys

import torch

from harness.config import load_config
from harness.errors import UserError
from harness.parallel import distributed
from harness.process import process_end
from harness.run.trainer import Trainer

TINY, STEPS = sys.argv[1], 3


def check_collectives(rank: int) -> None:
    assert distributed.all_reduce_flag(rank == 1) is True
    assert distributed.all_reduce_flag(False) is False
    assert distributed.all_ok(rank == 0) is False
    assert distributed.all_ok(True) is True
    assert distributed.rank0_flag(rank == 0) is True
    assert distributed.rank0_flag(rank == 1) is False
    assert distributed.on_rank0(distributed.rank) == 0
    assert distributed.broadcast_object({"from": rank}) == {"from": 0}
    assert distributed.all_gather_object(rank) == [0, 1]
    try:
        distributed.on_rank0(lambda: (_ for _ in ()).throw(UserError("decided on rank 0")))
    except UserError as e:
        assert "decided on rank 0" in str(e)
    else:
        raise AssertionError("on_rank0 did not raise rank 0's error on this rank")


def main() -> None:
    overrides = ["optim.type=muon", "model.args.dropout=0.0", "run_dir='unused'"]
    with distributed.process_group("cpu") as topo:
        assert topo.world_size == 2 and distributed.is_distributed()
        check_collectives(topo.rank)
        cfg = load_config(TINY, overrides)
        trainer = Trainer(cfg, rank=topo.rank, world_size=topo.world_size)
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        everyone = distributed.all_gather_object((losses, params))
        for name in params:
            assert torch.equal(everyone[0][1][name], everyone[1][1][name]), f"{name} differs across ranks"
        assert everyone[0][0] == everyone[1][0], "the logged (all-reduced) losses differ across ranks"
        if topo.rank == 0:
            # One process, the global batch (2 ranks x 4 samples) in one micro-batch of 8.
            single = Trainer(load_config(TINY, [*overrides, f"data.batch_size={2 * cfg.data.batch_size}"]))
            single_losses = [single.train_step().loss for _ in range(STEPS)]
            for name, p in single.model.named_parameters():
                torch.testing.assert_close(params[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
            assert max(abs(a - b) for a, b in zip(losses, single_losses, strict=True)) < 1e-5, (losses, single_losses)
        trainer.close()
    print(f"rank {topo.rank}: ok")


if __name__ == "__main__":
    main()
    process_end.end(0)  # as `harness` does after a process group (harness/process/process_end.py)
