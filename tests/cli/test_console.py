"""Issue 17 item 10: on a terminal, log lines never share a line with the progress bar."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from procs import ENV, ROOT, TINY


def test_log_lines_are_not_glued_to_the_progress_bar(tmp_path):
    main, child = pty.openpty()  # stderr is a terminal: the bar is drawn
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a new pty has 0 columns: no bar
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "train", str(TINY), "--run-dir", str(tmp_path / "run"),
                             "--set", "train.steps=12", "--set", "train.log_every=1", "--set", "checkpoint.every_steps=4"],
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
