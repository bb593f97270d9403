"""Peer copies among three ranks, each with a local folder of its own (three "nodes"), in one
torchrun group:

    torchrun --standalone --nproc-per-node 3 python peer_worker.py TMP

Every rank saves local checkpoints 2 and 4 (peer_jump 1: rank r's copies go to rank r + 1 mod 3);
node 1's folder is then deleted (the node is gone with its disk) and the ranks recover: rank 1
receives its part from rank 2 while rank 0 moves nothing. A resume from step 2 then deletes the
local checkpoints and peer copies past it. Then rank 0 sends rank 1 a checkpoint
whose file was damaged on rank 0's disk after its commit: rank 1 must not commit it. Each rank
writes what it saw to TMP/result-RANK.json. Messages on the wire are cut to 64 bytes, so every file
travels as many (`peer_copies.CHUNK_BYTES`), the ranks' counts differing.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from harness.checkpoint import CheckpointCorrupt, CheckpointStore, load
from harness.checkpoint.save import peer_copies
from harness.checkpoint.save.coverage import Coverage
from harness.checkpoint.save.local_recovery import LocalRecovery
from harness.checkpoint.save.local_tier import LocalTier
from harness.checkpoint.save.node_folders import folders
from harness.checkpoint.save.peer_copies import Incoming, Outgoing, transfer
from harness.config import LocalTierSection
from harness.parallel import distributed
from harness.process import process_end

RUN = "run-a"


def main() -> None:
    tmp = Path(sys.argv[1])
    peer_copies.CHUNK_BYTES = 64
    with distributed.process_group("cpu"):
        rank = distributed.rank()
        section = LocalTierSection(dir=str(tmp / f"node{rank}"), every_steps=2, keep=2, peer_jump=1)
        tier = LocalTier(section, RUN, resumed_step=0)
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 4)
        for step in (2, 4):
            tier.save(step, {"model": model}, {})
        tier.finish()  # the exchange of step 4 ran in the background
        distributed.barrier()
        if rank == 1:
            shutil.rmtree(tmp / "node1")
        distributed.barrier()
        # Each rank's model is its own (seeded by its rank): only the owner's copy serves a rank.
        recovery = LocalRecovery(section, RUN)
        chosen = recovery.choose(Coverage(global_data=True))
        ref = chosen.ref
        problem = recovery.problem(chosen.store, ref, chosen.store.open(ref).state, chosen.owner)
        result = {"step": ref.step, "tier": chosen.tier, "problems": [problem] if problem else [],
                  "owner": chosen.owner}
        loaded = torch.nn.Linear(4, 4)
        load(chosen.store, ref, {"model": loaded}, one_rank=True)
        result["same_model"] = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                      loaded.state_dict().values(), strict=True))
        # A resume from step 2 (an older tier): the local checkpoints and peer copies past it go.
        LocalTier(section, RUN, resumed_step=2)  # deletes what is past step 2 in every folder here
        result["kept"] = sorted({ref.step for folder in folders(section, RUN) for ref in folder.store.list()})
        if rank == 0:
            damaged = Path(tier.store.ref(2).path) / "model.safetensors"
            data = bytearray(damaged.read_bytes())
            data[-5] ^= 0x01
            damaged.write_bytes(bytes(data))
            transfer(Outgoing(1, tier.store, tier.store.ref(2)), None)
        if rank == 1:
            inbox = CheckpointStore(str(tmp / "inbox"))
            try:
                transfer(None, Incoming(0, inbox))
            except CheckpointCorrupt as e:
                result["damaged"] = str(e)
            result["inbox"] = [r.step for r in inbox.list()]
        (tmp / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    process_end.end(0)  # as `harness` does after a process group (harness/process/process_end.py)
