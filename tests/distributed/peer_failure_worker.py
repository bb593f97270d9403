"""A partner lost during a background peer exchange, two ranks in one torchrun group:

    torchrun --standalone --nproc-per-node 2 python peer_failure_worker.py TMP

Both ranks save local checkpoint 2 (peer_jump 1, each exchange held 2 s: debug.persist_delay_s);
rank 1 then ends while its exchange is held, as a lost node does. Rank 0's exchange fails on the
dead connection, and its next local saves go on: the failure logged, the copies stopped. Rank 0
writes what it saw to TMP/result.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from structlog.testing import capture_logs

from harness.checkpoint.save.local_tier import LocalTier
from harness.config import LocalTierSection
from harness.parallel import distributed
from harness.process import process_end


def main() -> None:
    tmp = Path(sys.argv[1])
    with distributed.process_group("cpu"):
        rank = distributed.rank()
        section = LocalTierSection(dir=str(tmp / f"node{rank}"), every_steps=2, keep=2, peer_jump=1)
        tier = LocalTier(section, "run-a", resumed_step=0, peer_delay_s=2.0)
        model = torch.nn.Linear(4, 4)
        tier.save(2, {"model": model}, {})
        if rank == 1:
            os._exit(0)  # gone, sockets and all, with its exchange not begun
        t0 = time.monotonic()
        with capture_logs() as logs:
            waited = [tier.save(step, {"model": model}, {}).waited_s for step in (4, 6)]
            tier.finish()
        result = {"seconds": time.monotonic() - t0, "waited": waited, "stopped": tier.peers.stopped,
                  "kept": [ref.step for ref in tier.store.list()],
                  "warnings": [e for e in logs if e["log_level"] == "warning"]}
        (tmp / "result.json").write_text(json.dumps(result, default=str))
        process_end.end(0)  # no barrier at the end of the group: rank 1 is gone


if __name__ == "__main__":
    main()
