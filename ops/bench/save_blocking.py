"""Where a training process's save blocks the step loop, part by part, on a real trainer.

A `Loop` save (harness/run/loop.py `save`) holds the step loop for: the finite-state check
(`Trainer.check_finite_state`: a sum of every floating tensor, so a NaN/inf state never becomes a
checkpoint), the snapshot's state dicts (`capture`) and the copy into the staging ring
(`AsyncSaver.save`). The `fingerprints` part's state dict holds the xxh3 hash of every other part,
recorded so a resume can check the restored state; in a background save the writer takes it from
the staged copies (checkpoint/later.py), and the row "fingerprints hash, live" is what it costs
where it is taken live (a synchronous save). ops/bench/scale.py times the copy alone against a torch copy;
this script builds the quickstart GPT at `--d-model`/`--layers` with AdamW (the default: 302M
parameters, 3.4 GiB of parameters and moments), trains one step on `--threads` threads, then in
`--rounds` rounds times each part and a plain torch copy of the same tensors into preallocated
host memory; and the rest of the background persist after the save returned (its writer also
takes the fingerprints' hash).

    python ops/bench/save_blocking.py [--d-model 1024 --layers 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.checkpoint import CheckpointStore  # noqa: E402
from harness.checkpoint.save.async_saver import AsyncSaver  # noqa: E402
from harness.checkpoint.save.commit import Committer  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.log import configure  # noqa: E402
from harness.run.trainer import Trainer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(CONFIG, [f"run_dir={tmp!r}", f"model.args.d_model={args.d_model}",
                                   f"model.args.n_layer={args.layers}", "model.args.n_head=16", "data.batch_size=2",
                                   "optim.type='adamw'", "optim.lr_muon=null", f"train.cpu_threads={args.threads}"])
        trainer = Trainer(cfg)
        trainer.train_step()  # AdamW makes its moments here
        parts = trainer.state.parts()
        tensors = [t for t in trainer.model.state_dict().values()]
        tensors += [v for opt in trainer.optim.optimizers.values() for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        limit = torch.empty(nbytes, dtype=torch.uint8)
        limit.zero_()
        saver = AsyncSaver(Committer(CheckpointStore(tmp, keep_last=2)), per_rank=trainer.state.per_rank)
        saver.prepare(parts)
        _ = saver.ring.nbytes  # allocated, as the step loop leaves it before a save
        rows = []
        for r in range(args.rounds):
            def copy() -> None:
                at = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    limit[at:at + n].copy_(t.reshape(-1).view(torch.uint8))
                    at += n

            row = {"finite check": timed(trainer.check_finite_state),
                   "fingerprints hash, live": timed(parts["fingerprints"].state_dict),
                   "torch copy": timed(copy),
                   "AsyncSaver.save": timed(lambda r=r: saver.save(r + 1, parts))}
            row["persist, after the save"] = timed(saver.finish)
            rows.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)
        gib = nbytes / 2**30
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        loop = med["finite check"] + med["AsyncSaver.save"]
        millions = sum(p.numel() for p in trainer.model.parameters()) / 1e6
        print(f"{gib:.2f} GiB of parameters and AdamW moments ({millions:.0f}M parameters), {args.threads} "
              f"thread(s), medians of {args.rounds} rounds:")
        for k, v in med.items():
            print(f"  {k:26s} {v:.3f} s  ({v / gib:.3f} s/GiB)")
        print(f"  a Loop save blocks for     {loop:.3f} s = {loop / med['torch copy']:.2f}x the torch copy "
              f"(finite check + AsyncSaver.save; load average "
              f"{os.getloadavg()[0]:.1f})")
        trainer.close()


if __name__ == "__main__":
    main()
