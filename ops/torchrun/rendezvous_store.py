"""A c10d rendezvous store that no training node hosts, for elastic torchrun groups.

    python ops/torchrun/rendezvous_store.py [--host 0.0.0.0] --port 29400

Agents then use `--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-conf is_host=false`
(ops/torchrun/train.sh: NNODES=MIN:MAX RDZV_ENDPOINT=HOST:PORT RDZV_CONF=is_host=false). By default
the first agent whose address matches the endpoint hosts the store inside its own process, so a
group whose host node is lost loses its rendezvous too, and the survivors cannot regroup at a
smaller world size; this store outlives any node. It runs until killed (SIGTERM, SIGINT).
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=29400)
    args = p.parse_args()
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
    print(f"rendezvous store listening on {args.host}:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
