"""The console: on a terminal, log lines never share a line with the progress bar; in a launch of
several ranks, rank 0 alone prints the info lines and the other ranks' lines carry their rank."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from procs import ENV, ROOT, TINY, harness


def test_log_lines_are_not_glued_to_the_progress_bar(tmp_path):
    main, child = pty.openpty()  # stderr is a terminal: the bar is drawn
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a new pty has 0 columns: no bar
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "train", str(TINY),
                             "--run-dir", str(tmp_path / "run"), "--set", "train.steps=12",
                             "--set", "train.log_every=1", "--set", "checkpoint.every_steps=4"],
                            stdout=subprocess.DEVNULL, stderr=child, stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=300) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # drop colours and cursor moves
    segments = re.split(r"[\r\n]", text)
    steps = [s for s in segments if "grad_norm" in s]
    assert len(steps) == 12, text[-2000:]
    assert not [s for s in steps if "%|" in s or "train:" in s], text[-2000:]  # the bar's own text
    assert any("%|" in s for s in segments)  # and the bar was drawn


# Logs an info line, a warning, and a warning that names its rank, as the harness's code does.
LINES = ("from harness.log import configure, get_logger; import sys; configure(sys.argv[1]); log = get_logger(); "
         "log.info('step', step=4); log.warning('storage is slow'); log.warning('hung', rank=1)")


@pytest.mark.parametrize("rank, level, expected", [
    ("0", "info", ["step", "storage is slow", "hung"]),
    ("1", "info", ["rank 1: storage is slow", "hung"]),
    ("1", "debug", ["rank 1: step", "rank 1: storage is slow", "hung"]),
])
def test_a_rank_other_than_0_leaves_the_info_lines_to_rank_0_and_names_itself(rank, level, expected):
    proc = subprocess.run([sys.executable, "-c", LINES, level], capture_output=True, text=True, cwd=ROOT,
                          env={**ENV, "RANK": rank, "WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr
    messages = [line.split("] ", 1)[1].split("  ")[0].strip() for line in proc.stderr.splitlines()]
    assert messages == expected, proc.stderr


def test_the_error_line_of_a_rank_other_than_0_starts_with_its_rank(tmp_path):
    proc = harness("train", str(tmp_path / "missing.toml"), env={**ENV, "RANK": "1", "WORLD_SIZE": "2"})
    assert proc.returncode == 2 and proc.stderr.startswith("rank 1: error: config file"), proc.stderr
