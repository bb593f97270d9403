"""Goodput of a long job at cluster scale, persistent checkpoints alone vs with the local tier.

A first-order model (Young 1974; Daly 2006), pure arithmetic, its inputs as arguments:
* failures: each of `--nodes` nodes fails independently with mean time `--node-mtbf-h`, so the
  job fails every M = node MTBF / nodes;
* each tier's cost: the seconds of a blocking save and of a restore measured by
  ops/bench/recovery.py on a `--bench-mib` checkpoint, scaled linearly to `--state-gib` per node
  (every node writes and reads its own part at the measured rate, in parallel); with peer copies,
  a local save also sends the state to a peer node at `--peer-gibps`;
* a tier saved every T seconds at cost C wastes C / T of the time, and a failure it recovers loses
  T / 2 on average plus its restore and `--restart-s`; T = sqrt(2 C M_tier) (Young/Daly, as
  `every_steps = "auto"` chooses it, harness/run/cadence.py), M_tier the mean time between the
  failures that tier recovers;
* with the local tier a fraction `--local-covers` of failures resumes from it (the process's own
  copy, or a peer's for a lost node); the rest (a node and its peer lost together, a whole-cluster
  outage, a damaged copy) from the persistent tier, whose interval is then chosen for those alone.
Goodput = 1 - the time saving - the time lost to failures, per unit time.

    python ops/bench/goodput_model.py [--nodes 1024 --node-mtbf-h 6300 --state-gib 15 ...]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """A checkpoint tier at cluster scale: `save_s` blocking seconds a save, `restore_s` seconds a
    restore, `mtbf_s` the mean seconds between the failures it recovers."""

    save_s: float
    restore_s: float
    mtbf_s: float

    @property
    def interval_s(self) -> float:
        return math.sqrt(2.0 * self.save_s * self.mtbf_s)

    def waste(self, restart_s: float) -> float:
        """The fraction of time this tier costs: saving, plus per failure it recovers half an
        interval redone, the restore and the restart."""
        return self.save_s / self.interval_s + (self.interval_s / 2 + self.restore_s + restart_s) / self.mtbf_s


def model(args: argparse.Namespace) -> dict[str, float]:
    """The job MTBF, each tier's costs and interval, and the goodput of both arrangements."""
    job_mtbf_s = args.node_mtbf_h * 3600.0 / args.nodes
    scale = args.state_gib * 1024.0 / args.bench_mib
    peer_s = args.state_gib / args.peer_gibps
    alone = Tier(args.persistent_save_s * scale, args.persistent_restore_s * scale, job_mtbf_s)
    local = Tier(args.local_save_s * scale + peer_s, args.local_restore_s * scale, job_mtbf_s / args.local_covers)
    rare = Tier(alone.save_s, alone.restore_s, job_mtbf_s / (1.0 - args.local_covers))
    return {"job_mtbf_s": job_mtbf_s, "persistent_save_s": alone.save_s, "persistent_restore_s": alone.restore_s,
            "local_save_s": local.save_s, "local_restore_s": local.restore_s, "peer_copy_s": peer_s,
            "persistent_alone_interval_s": alone.interval_s,
            "goodput_persistent_alone": 1.0 - alone.waste(args.restart_s),
            "local_interval_s": local.interval_s, "persistent_with_local_interval_s": rare.interval_s,
            "goodput_with_local": 1.0 - local.waste(args.restart_s) - rare.waste(args.restart_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--node-mtbf-h", type=float, default=6300.0,
                   help="hours; default from Llama 3's 419 unexpected interruptions in 54 days on 2,048 8-GPU nodes")
    p.add_argument("--state-gib", type=float, default=15.0,
                   help="checkpoint GiB per node; default: 1e12 parameters x 16 bytes (mixed-precision Adam) / 1,024")
    p.add_argument("--bench-mib", type=float, default=25.9, help="the checkpoint size the costs below were measured at")
    p.add_argument("--persistent-save-s", type=float, default=0.670, help="measured: S3 save, blocking")
    p.add_argument("--persistent-restore-s", type=float, default=0.134, help="measured: S3 restore")
    p.add_argument("--local-save-s", type=float, default=0.032, help="measured: local tier (/dev/shm) save")
    p.add_argument("--local-restore-s", type=float, default=0.059, help="measured: local tier restore")
    p.add_argument("--peer-gibps", type=float, default=10.0, help="GiB/s a peer copy travels between nodes")
    p.add_argument("--local-covers", type=float, default=0.9, help="the fraction of failures the local tier recovers")
    p.add_argument("--restart-s", type=float, default=3.8, help="process launch to training, before the restore")
    args = p.parse_args()
    if not 0.0 < args.local_covers < 1.0:
        p.error("--local-covers must be between 0 and 1, both excluded")
    for key, value in model(args).items():
        print(f"{key:<34} {value:.4f}" if key.startswith("goodput") else f"{key:<34} {value:,.1f}")


if __name__ == "__main__":
    main()
