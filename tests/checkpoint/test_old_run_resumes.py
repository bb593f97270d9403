"""A run written before the package moves (harness at commit 7d7774c) resumes after them, bit for bit.

`data/run-7d7774c/` is the run dir of this command at that commit (metrics.jsonl left out), and
is not regenerated (run as tests/procs.py runs `harness`, OMP_NUM_THREADS=1):

    harness train configs/quickstart.toml --run-dir RUN --set train.steps=8 \\
      --set checkpoint.every_steps=4 --set checkpoint.keep_last=2 --set data.seq_len=32 \\
      --set data.batch_size=4 --set model.args.n_layer=1 --set model.args.d_model=16 \\
      --set model.args.n_head=2 --set train.eval_every=0 --set optim.warmup=2

Its step-4 checkpoint is resumed by today's code and trained to step 8; the result must equal the
step-8 checkpoint the old code wrote (parameters, optimizer, RNG streams, data position). Exact
resume is promised on the same CPU and library versions; on another the comparison is expected to
fail in the last bits, and only the resume itself is checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.checkpoint import CheckpointStore
from harness.checkpoint.diff import compare_checkpoints
from harness.repro.numerics import cpu
from tests.procs import ROOT, harness

OLD_RUN = Path(__file__).parent / "data" / "run-7d7774c"
SETTINGS = ["train.steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=2", "data.seq_len=32",
            "data.batch_size=4", "model.args.n_layer=1", "model.args.d_model=16", "model.args.n_head=2",
            "train.eval_every=0", "optim.warmup=2"]

RECORDED = json.loads((OLD_RUN / "checkpoints" / "step-00000004" / "state.json").read_text())["meta"]["environment"]
SAME_MACHINE = RECORDED["torch"] == torch.__version__ and RECORDED["numerics"]["cpu"] == cpu().model


@pytest.mark.xfail(not SAME_MACHINE, strict=False, reason="the fixture was written on another CPU or torch version")
def test_a_run_written_by_the_old_layout_resumes_bitwise(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    sets = [arg for s in SETTINGS for arg in ("--set", s)]
    done = harness("train", str(ROOT / "configs" / "quickstart.toml"), "--run-dir", str(run), *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resum" in done.stderr
    old, new = CheckpointStore(str(OLD_RUN)), CheckpointStore(str(run))
    result = compare_checkpoints((old, old.ref(8)), (new, new.ref(8)))
    # The one difference by design: a fingerprint record's lr is the lr its step trained with since
    # issue 69 (the old code recorded the next step's), so the records of steps 5-8, which this code
    # trained, hold the lr the old code's records held one step earlier.
    records = [store.read_state(store.ref(8))["parts"]["fingerprints"]["records"] for store in (old, new)]
    assert [r["lr"] for r in records[1][4:]] == [r["lr"] for r in records[0][3:7]]
    shifted = {f"parts/fingerprints/records/{i}/lr" for i in range(4, 8)}
    others = [d.line for d in result.differences if not any(d.where.startswith(p + "/") for p in shifted)]
    assert not others, "\n".join(result.lines)
