"""The fork server (harness/forkserver): its children are `harness` processes that neither the
numerics nor the process tree can tell from fresh interpreters, and what it cannot honour starts
fresh. The module has a pool of its own (not the session's), so each test knows which server it
uses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

from harness.forkserver.client import ForkServer
from harness.forkserver.pool import ForkServers, popen_for
from harness.forkserver.relay import SERVER_ENV
from procs import DEFAULT_THREADS_ENV, ENV, ROOT, TINY, assert_same_run, wait_for_step


@pytest.fixture(scope="module")
def servers():
    pool = ForkServers(ROOT)
    yield pool
    pool.close()


def launch(popen, *args: str, env: dict = ENV, cwd=ROOT, **kwargs) -> subprocess.Popen:
    return popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True, env=env, cwd=cwd, **kwargs)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def numerics_recorded(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["environment"]["numerics"]


@pytest.mark.parametrize("threads", [[], ["--set", "train.cpu_threads=2"]], ids=["default", "pinned-2"])
def test_a_forked_run_is_bitwise_a_fresh_one(tmp_path, servers, threads):
    """Same checkpoint bytes and losses, and the same numerics settings in force (threads, MKL's
    strict mode, the environment prepare_environment fixes): with the thread count the
    environment gives, and pinned to two by the config (an intra-op pool the child starts)."""
    args = ["train", str(TINY), "--set", "optim.type=muon", *threads]
    forked = launch(servers.popen, *args, "--run-dir", str(tmp_path / "forked"))
    assert forked.forked
    assert finish(forked)[0] == 0, forked.stderr
    fresh = launch(subprocess.Popen, *args, "--run-dir", str(tmp_path / "fresh"))
    assert finish(fresh)[0] == 0
    assert_same_run(tmp_path / "forked", tmp_path / "fresh", 12)
    assert numerics_recorded(tmp_path / "forked") == numerics_recorded(tmp_path / "fresh")
    assert numerics_recorded(tmp_path / "forked")["cpu_threads"] == (2 if threads else 1)


def test_an_environment_a_server_cannot_honour_starts_fresh(tmp_path):
    """A server started with ENV, asked for another value where the libraries read it at
    start-up (MKL's mode), starts a fresh interpreter, which runs with the value asked for."""
    folder = tempfile.mkdtemp(prefix="harness-fs-")
    server = ForkServer(ENV, ROOT, folder)
    try:
        assert launch(server.popen, "--help").forked
        own_mode = launch(server.popen, "train", str(TINY), "--run-dir", str(tmp_path / "strict-off"),
                          "--set", "train.steps=1", env={**ENV, "MKL_CBWR": "AUTO"})
        assert not own_mode.forked
        code, _, err = finish(own_mode)
    finally:
        server.close()
        shutil.rmtree(folder)
    assert code == 0 and "MKL_CBWR in the environment is not strict" in err, err
    assert numerics_recorded(tmp_path / "strict-off")["env"]["MKL_CBWR"] == "AUTO"


def test_default_threads_start_fresh(tmp_path, servers):
    """With torch's default thread count its import starts an OpenMP pool: no server can fork
    safely there (one started so exits UNSERVABLE; a pool starts none), and runs start fresh, on
    that thread count."""
    folder = tempfile.mkdtemp(prefix="harness-fs-")
    server = ForkServer(DEFAULT_THREADS_ENV, ROOT, folder)
    try:
        default_threads = launch(server.popen, "train", str(TINY), "--run-dir", str(tmp_path / "threads"),
                                 "--set", "train.steps=1", env=DEFAULT_THREADS_ENV)
        assert not default_threads.forked and server.unservable()
    finally:
        server.close()
        shutil.rmtree(folder)
    assert servers.server_for(DEFAULT_THREADS_ENV) is None
    assert finish(default_threads)[0] == 0
    torch_default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                   capture_output=True, text=True, env=DEFAULT_THREADS_ENV, check=True).stdout
    assert numerics_recorded(tmp_path / "threads")["cpu_threads"] == int(torch_default)


def test_a_working_folder_that_would_shadow_an_import_starts_fresh(tmp_path, servers):
    (tmp_path / "optim").mkdir()  # `python -m` in this folder would import this `optim`, not the harness's
    assert not launch(servers.popen, "--help", cwd=tmp_path).forked


def test_outputs_and_exit_codes_are_a_fresh_interpreters(tmp_path, servers):
    for args in (["--help"], ["nosuch"], ["train", str(TINY), "--set", "optim.lrr=1"]):
        forked = launch(servers.popen, *args)
        assert forked.forked
        assert finish(forked) == finish(launch(subprocess.Popen, *args)), args


def test_a_forked_child_is_a_real_process(tmp_path, servers):
    """In the caller's process group (as a Popen child), or a session of its own when asked; a
    relative path resolves in its own working folder; SIGKILL ends it with -9, SIGTERM to its
    process group is a preemption (exit 75) as for any `harness train`."""
    run = tmp_path / "run"
    proc = launch(servers.popen, "train", str(TINY), "--run-dir", "run", "--set", "train.steps=400", cwd=tmp_path)
    assert proc.forked
    wait_for_step(proc, run, 2)
    assert os.getpgid(proc.pid) == os.getpgid(0) and os.getsid(proc.pid) == os.getsid(0)
    proc.send_signal(signal.SIGKILL)
    assert finish(proc)[0] == -signal.SIGKILL
    proc.send_signal(signal.SIGKILL)  # gone and reaped: nothing to signal, as for a Popen child
    alone = launch(servers.popen, "train", str(TINY), "--run-dir", str(tmp_path / "alone"), "--set",
                   "train.steps=400", start_new_session=True)
    wait_for_step(alone, tmp_path / "alone", 1)
    assert os.getsid(alone.pid) == alone.pid and os.getpgid(alone.pid) == alone.pid
    os.killpg(alone.pid, signal.SIGTERM)
    code, _, err = finish(alone)
    assert code == 75, err


EXIT_PROBE = '''
import atexit, os, threading, time
from harness.models.gpt import build_gpt as build

def _late():
    time.sleep(0.5)
    os.write(2, b"non-daemon thread done\\n")

class _Freed:
    def __del__(self, write=os.write):
        write(2, b"freed at finalization\\n")

atexit.register(lambda: os.write(2, b"atexit handler ran\\n"))
threading.Thread(target=_late).start()
FREED = _Freed()
'''


def test_a_forked_child_ends_as_a_fresh_one_up_to_finalization(tmp_path, servers):
    """A non-daemon thread is waited for and the atexit handlers run, as in a fresh interpreter;
    then the child leaves without freeing what is still alive (harness/forkserver/child.py): an
    object's `__del__` at finalization runs only in the fresh one."""
    (tmp_path / "exit_probe.py").write_text(EXIT_PROBE)
    args = ["train", str(TINY), "--set", "train.steps=1", "--set", 'model.factory="exit_probe:build"']
    forked = launch(servers.popen, *args, "--run-dir", "forked", cwd=tmp_path)
    assert forked.forked
    code, _, err = finish(forked)
    fresh_code, _, fresh_err = finish(launch(subprocess.Popen, *args, "--run-dir", "fresh", cwd=tmp_path))
    for text in (err, fresh_err):  # the thread first, then the handlers, as Py_FinalizeEx orders them
        assert 0 <= text.find("non-daemon thread done") < text.find("atexit handler ran"), text
    assert code == fresh_code == 0, err
    assert "freed at finalization" in fresh_err and "freed at finalization" not in err


def test_popen_for_forks_only_where_a_server_can_serve(tmp_path, servers):
    """verify-resume's starter (harness/forkserver/pool.py): a server's children with one OpenMP
    thread; with torch's default thread count plain Popen, no server started to refuse; where the
    environment names a server, that one's children, and a fresh interpreter where it is gone."""
    with popen_for(ENV, ROOT) as popen:
        proc = launch(popen, "--help")
        assert proc.forked and finish(proc)[0] == 0
    with popen_for(DEFAULT_THREADS_ENV, ROOT) as popen:
        assert popen is subprocess.Popen
    named = servers.server_for(ENV)
    with popen_for({**ENV, SERVER_ENV: named.socket_path}, ROOT) as popen:
        proc = launch(popen, "train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", "train.steps=400")
        wait_for_step(proc, tmp_path / "run", 1)
        assert proc.forked and psutil.Process(proc.pid).ppid() == named.process.pid
        proc.kill()
        assert finish(proc)[0] == -signal.SIGKILL
    with popen_for({**ENV, SERVER_ENV: os.path.join(servers.folder, "gone.sock")}, ROOT) as popen:
        proc = launch(popen, "--help")
        assert not proc.forked and finish(proc)[0] == 0


SCRIPT_PROBE = '''
import os, sys
print(__name__, sys.argv[1:], sys.path[0] == os.path.dirname(os.path.realpath(__file__)), os.getcwd())
'''


def test_a_script_runs_as_the_interpreter_runs_it(tmp_path, servers):
    """`python SCRIPT ARGS` (the tests' rank workers): forked, with the script's folder first on
    sys.path and its arguments, as a fresh interpreter runs it, in the caller's working folder."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "probe.py"
    script.write_text(SCRIPT_PROBE)
    command = [sys.executable, "scripts/probe.py", "a", "b"]
    forked = servers.popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    assert forked.forked
    fresh = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    assert finish(forked) == finish(fresh) == (0, f"__main__ ['a', 'b'] True {tmp_path}\n", "")
