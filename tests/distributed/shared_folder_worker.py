"""Three ranks on two "nodes" in one torchrun group: rank 0 with a local folder of its own (node 0),
ranks 1 and 2 sharing one (node 1), as the ranks of a node share its `checkpoint.local.dir`:

    torchrun --standalone --nproc-per-node 3 python shared_folder_worker.py TMP

Every rank saves local checkpoints 2 and 4 of a model of its own, in exact elastic mode (a copy
serves any rank of a world of its size), peer copies going to rank + 1: rank 0's to node 1, rank
1's stay on node 1, rank 2's go to node 0. Then:
1. node 1's copy of rank 0's step 4 is damaged and the ranks recover: every rank loads its own
   step 4 from its node, and node 1's copies are each verified by one of its ranks (the damaged
   one reported once).
2. node 1's folder is gone, and node 0's copy of rank 2's too: only rank 0's copies survive, and
   both ranks of node 1 are served by rank 0's step 4, which travels to node 1 once.
Each rank writes what it saw to TMP/result-RANK.json.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from harness.checkpoint import load
from harness.checkpoint.save import local_recovery
from harness.checkpoint.save.coverage import Coverage
from harness.checkpoint.save.local_recovery import LocalRecovery
from harness.checkpoint.save.local_tier import LocalTier
from harness.config import LocalTierSection
from harness.parallel import distributed
from harness.process import process_end

RUN = "run-a"
EXACT = {"config": {"parallel": {"exact_elastic": True}}}


def recover(section: LocalTierSection, model: torch.nn.Module, received: list[int]) -> dict:
    """The ranks recover from the local tier; what this rank chose and loaded, and what arrived."""
    received.clear()
    recovery = LocalRecovery(section, RUN)
    chosen = recovery.choose(Coverage(global_data=True))
    assert chosen is not None
    loaded = torch.nn.Linear(4, 4)
    load(chosen.store, chosen.ref, {"model": loaded}, one_rank=True)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(),
                                                   strict=True))
    return {"step": chosen.ref.step, "owner": chosen.owner, "tier": chosen.tier, "url": chosen.store.url,
            "same_model": same, "received": list(received),
            "rejected": [(r["rank"], r["owner"], r["step"]) for r in recovery.rejected if "owner" in r]}


def main() -> None:
    tmp = Path(sys.argv[1])
    received: list[int] = []
    real = local_recovery.transfer

    def counting(outgoing, incoming):  # noqa: ANN001, ANN202  # the receiving side of each transfer, counted
        if incoming is not None:
            received.append(incoming.sender)
        return real(outgoing, incoming)

    local_recovery.transfer = counting
    with distributed.process_group("cpu"):
        rank = distributed.rank()
        section = LocalTierSection(dir=str(tmp / f"node{min(rank, 1)}"), every_steps=2, keep=2, peer_jump=1)
        tier = LocalTier(section, RUN, resumed_step=0)
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 4)
        for step in (2, 4):
            tier.save(step, {"model": model}, EXACT)
        tier.finish()
        distributed.barrier()
        (run_folder,) = (tmp / "node1").iterdir()
        if rank == 1:
            damaged = run_folder / "peer-of-rank-00000" / "checkpoints" / "step-00000004" / "model.safetensors"
            data = bytearray(damaged.read_bytes())
            data[-5] ^= 0x01
            damaged.write_bytes(bytes(data))
        distributed.barrier()
        result = {"own": recover(section, model, received)}
        distributed.barrier()
        if rank == 1:
            shutil.rmtree(tmp / "node1")
            shutil.rmtree(tmp / "node0" / run_folder.name / "peer-of-rank-00002")
        distributed.barrier()
        torch.manual_seed(0)
        result["node_lost"] = recover(section, torch.nn.Linear(4, 4), received)  # rank 0's model
        (tmp / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    process_end.end(0)  # as `harness` does after a process group (harness/process/process_end.py)
