"""ops/diag/omp_teams.c, the issue-16 diagnostic, reports what it is meant to: the team size of
each OpenMP region per calling thread, and the SSE control words the threads computed under."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from procs import DEFAULT_THREADS_ENV, ROOT

SOURCE = ROOT / "ops" / "diag" / "omp_teams.c"
TORCH_GOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"

WORK = """
import torch
torch.set_num_threads(2)
x = torch.randn(512, 512, requires_grad=True)
torch.nn.functional.layer_norm(x, (512,)).sum().backward()
torch.set_flush_denormal(True)  # this thread only: its OpenMP worker keeps the default control word
(x.detach() * 2).sum()
"""


@pytest.mark.skipif(shutil.which("gcc") is None or not TORCH_GOMP.exists(),
                    reason="needs gcc and a torch build on GNU OpenMP (x86 Linux wheels)")
def test_the_wrapper_counts_team_sizes_and_control_words(tmp_path):
    library = tmp_path / "omp_teams.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(SOURCE), "-ldl"], check=True)
    out = tmp_path / "teams"
    env = {**DEFAULT_THREADS_ENV, "LD_PRELOAD": str(library), "GOMP_SHIM_OUT": str(out),
           "GOMP_SHIM_LIB": str(TORCH_GOMP)}
    proc = subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = [p for p in tmp_path.iterdir() if p.name.startswith("teams.")]
    lines = report.read_text().splitlines()
    regions = int(lines[0].split()[1])
    main = next(line for line in lines if line.startswith("main"))
    assert regions > 0 and " 2:" in main  # the main thread's regions ran on teams of 2
    control_words = {line.split()[1] for line in lines if line.startswith("mxcsr")}
    assert control_words == {"0x1f80", "0x9fc0"}  # default, and flush-to-zero + denormals-are-zero

    # A team smaller than asked outside nesting (here forced by OpenMP's thread limit) is written
    # the moment it runs: a SIGKILLed process never writes its report at exit.
    limited = tmp_path / "limited"
    limited.mkdir()
    env = {**env, "GOMP_SHIM_OUT": str(limited / "teams"), "OMP_THREAD_LIMIT": "1"}
    proc = subprocess.run([sys.executable, "-c", WORK + "import os\nos.kill(os.getpid(), 9)\n"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [p.name for p in limited.iterdir()] == ["teams.short"], proc.stderr[-2000:]
    witness = (limited / "teams.short").read_text().splitlines()
    assert witness and all(re.fullmatch(r"pid=\d+ tid=\d+ main=1 expected=2 requested=\d+ got=1 region=\d+", line)
                           for line in witness), witness
