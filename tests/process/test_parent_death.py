"""die_with_relay (harness/process/parent_death.py): the kernel SIGKILLs a process when the last
writer of its lifeline pipe closes, however busy the process is, and at once when there was none
left by the time it asked. Real processes (no torch: a plain interpreter with the harness on its path)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Asks, says so, then spins in Python for ever: the main thread holds the GIL all the while.
PROBE = """
import sys
from harness.process import parent_death
parent_death.die_with_relay(int(sys.argv[1]))
print("asked", flush=True)
while True:
    sum(range(1000))
"""


def probe(lifeline: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, str(lifeline)], pass_fds=[lifeline], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_process_is_killed_the_moment_its_lifelines_writer_closes():
    lifeline, writer = os.pipe()  # this test stands for the relay: it alone holds the writer
    proc = probe(lifeline)
    os.close(lifeline)
    assert proc.stdout.readline() == "asked\n"
    os.close(writer)
    proc.communicate(timeout=120)
    assert proc.returncode == -9


def test_a_lifeline_without_a_writer_kills_at_once():
    """The relay died before the process asked: no close is left to signal it."""
    lifeline, writer = os.pipe()
    os.close(writer)
    proc = probe(lifeline)
    os.close(lifeline)
    out, _ = proc.communicate(timeout=120)
    assert (proc.returncode, out) == (-9, "")
