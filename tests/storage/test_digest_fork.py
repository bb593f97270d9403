"""A forked child can hash after its parent hashed over every core (digest.py). BLAKE3's thread
pool does not survive a fork; a DataLoader worker verifying a data shard hung forever on it (a
full-suite run: tests/data's mixed-shard SIGKILL test and the workers' world-size test, both
with loader workers, stuck at 0% CPU)."""

import subprocess
import sys
import textwrap

from procs import ENV, ROOT

PARENT_THEN_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import blake3
    from harness.storage.digest import new_hasher

    data = os.urandom(32 << 20)
    # Over blake3's process-wide pool (its AUTO), which is where the hang was; the harness's own
    # hashers now use pools of their own, so the parent is anything in the process that hashed.
    expected = blake3.blake3(max_threads=blake3.blake3.AUTO)
    expected.update(data)  # large enough to run over every core: the pool starts here
    expected = expected.hexdigest()
    for threads in (2, None):  # and the harness's own pools
        h = new_hasher("blake3", threads)
        h.update(data)
        assert h.hexdigest() == expected
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker is such a fork
        h = new_hasher("blake3")
        h.update(data)
        os.write(write, h.hexdigest().encode())
        os._exit(0)
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            sys.exit("the forked child's hash did not finish in 60 s")
        time.sleep(0.05)
    os.close(write)
    assert os.read(read, 100).decode() == expected
""")


def test_a_forked_child_hashes_after_its_parent_used_every_core():
    proc = subprocess.run([sys.executable, "-c", PARENT_THEN_CHILD], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
