"""Load a checkpoint the way `harness train` does, gather the whole training state, train on.

    [torchrun --nproc-per-node N] python gather_worker.py CKPT_URL STRATEGY OUT [CONFIG_OVERRIDE ...]

(CONFIG_OVERRIDE: `key=value` on tests/data/tiny.toml, e.g. `train.steps=16` to go past a finished
checkpoint; a changed config is allowed.)

Every rank resumes from the checkpoint folder CKPT_URL (run/resume.py: rank 0 verifies it, every
rank loads it) with `parallel.strategy = STRATEGY`; then every parameter and optimizer tensor is
gathered whole (`DTensor.full_tensor()`: an all-gather of the live shards, not a read of the
checkpoint) and rank 0 writes them to the safetensors file OUT, named `model/NAME` and
`optim/OPT/NAME/KEY`. Then two more training steps run (the loaded state trains).
"""

import sys
from pathlib import Path

from harness.repro import numerics

numerics.prepare_environment()  # as `harness train` does, before torch loads

from harness.checkpoint import CheckpointStore  # noqa: E402
from harness.checkpoint.tensorfile import serialize  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.parallel import distributed  # noqa: E402
from harness.parallel.sharding import full_value  # noqa: E402
from harness.process import process_end  # noqa: E402
from harness.run.resume import Resume  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny.toml"


def gathered(trainer) -> dict:
    out = {f"model/{n}": full_value(p.detach()) for n, p in trainer.model.named_parameters()}
    for opt_name, opt in trainer.optim.optimizers.items():
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                for key, value in opt.state[p].items():
                    out[f"optim/{opt_name}/{name}/{key}"] = full_value(value.detach())
    return out


def main() -> None:
    ckpt, strategy, out, *overrides = sys.argv[1:]
    run_dir = ckpt.rsplit("/checkpoints/", 1)[0]
    cfg = load_config(TINY, [f"run_dir='{run_dir}'", f"parallel.strategy='{strategy}'", *overrides])
    with distributed.process_group("cpu"):
        started = Resume(cfg, CheckpointStore(run_dir), ckpt, allow_config_change=True).start()
        trainer, ref = started.trainer, started.chosen.ref
        state = gathered(trainer)
        if distributed.rank() == 0:
            with open(out, "wb") as f:
                for chunk in serialize({k: v.cpu() for k, v in state.items()}, out):
                    f.write(chunk)
        for _ in range(2):
            trainer.train_step()
        trainer.close()
        print(f"rank {distributed.rank()}: loaded step {ref.step}, trained 2 more steps")


if __name__ == "__main__":
    main()
    process_end.end(0)  # as `harness` does after a process group (harness/process/process_end.py)
