"""Supervisor: restarts, crash-loop limit, exit codes, signal forwarding, with real processes.

The child is a fake trainer: a hash chain stands in for the model (so "bitwise equal to an
uninterrupted run" is a string comparison), its checkpoint is a JSON file committed by
write-temp-then-rename, and FAKE_CRASH selects a fault. The supervisor runs in-process where
the test only needs its return value, and as a real process where it is signalled or killed.
"""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from harness.cli import main
from harness.exit_codes import FINISHED, GAVE_UP, PREEMPTED, STORAGE_UNAVAILABLE, USER_ERROR
from harness.process.supervisor import Supervisor, describe_exit, strip_flags
from harness.records.events import EventLog

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

TRAINER = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys, time
    from harness.exit_codes import PREEMPTED, STORAGE_UNAVAILABLE, USER_ERROR
    from harness.log import configure
    from harness.process.signals import PreemptionWatch, SaveDeadline

    configure()
    run_dir, steps, every, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    # FAKE_CRASH: once:K:exit|raise|kill, always:K, after_each_checkpoint, user_error, outage:N
    crash = os.environ.get("FAKE_CRASH", "")
    ckpt = os.path.join(run_dir, "ckpt.json")

    def commit(step, value):
        tmp = f"{ckpt}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"step": step, "value": value}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt)

    def first_time(name):
        path = os.path.join(run_dir, "marker-" + name)
        if os.path.exists(path):
            return False
        open(path, "w").close()
        return True

    def crash_hook(step):
        kind, _, arg = crash.partition(":")
        if kind == "once" and step == int(arg.split(":")[0]) and first_time(f"once-{step}"):
            mode = arg.split(":")[1]
            print(f"crash once at step {step}", file=sys.stderr, flush=True)
            if mode == "raise":
                raise RuntimeError(f"planned crash at step {step}")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(13)
        if kind == "always" and step == int(arg):
            print(f"boom at step {step}", file=sys.stderr, flush=True)
            os._exit(13)

    if crash == "user_error":
        print("error: bad config key 'lr'", file=sys.stderr)
        sys.exit(USER_ERROR)
    if crash.startswith("outage:") and any(first_time(f"outage-{i}") for i in range(int(crash[7:]))):  # N outages
        print("error: storage endpoint http://s3 unavailable: S3 head_object ...", file=sys.stderr)
        sys.exit(STORAGE_UNAVAILABLE)
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "value": "seed"}
    step, value = state["step"], state["value"]
    with PreemptionWatch() as watch:
        print(f"started at step {step} pid {os.getpid()}", file=sys.stderr, flush=True)
        while step < steps:
            if watch.requested:
                with SaveDeadline(5, since=watch.requested_at):
                    commit(step, value)
                sys.exit(PREEMPTED)
            time.sleep(step_s)
            value = hashlib.sha256(f"{value}:{step}".encode()).hexdigest()
            step += 1
            crash_hook(step)
            if step % every == 0 or step == steps:
                commit(step, value)
                if crash == "after_each_checkpoint" and step < steps and first_time(f"ckpt-{step}"):
                    os._exit(13)
    """
)

DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from harness.records.events import EventLog
    from harness.log import configure
    from harness.process.supervisor import Supervisor

    configure()
    run_dir, cmd = sys.argv[1], sys.argv[2:]

    def progress():
        try:
            return json.load(open(os.path.join(run_dir, "ckpt.json")))["step"]
        except FileNotFoundError:
            return None

    sys.exit(Supervisor(cmd, max_restarts=20, crash_loop_limit=10, progress=progress,
                        backoff_initial=0.01, backoff_max=0.05, jitter=0.01,
                        events=EventLog(os.path.join(run_dir, "events.jsonl"))).run())
    """
)


def uninterrupted(steps):
    value = "seed"
    for step in range(steps):
        value = hashlib.sha256(f"{value}:{step}".encode()).hexdigest()
    return value


class Run:
    """A run dir with the fake trainer; builds commands, supervisors and reads results."""

    def __init__(self, root: Path, steps=12, every=4, step_s=0.01) -> None:
        self.dir = root
        (root / "trainer.py").write_text(TRAINER)
        (root / "driver.py").write_text(DRIVER)
        self.cmd = [sys.executable, str(root / "trainer.py"), str(root), str(steps), str(every), str(step_s)]
        self.steps = steps
        self.events = EventLog(root / "events.jsonl")

    def progress(self):
        path = self.dir / "ckpt.json"
        return json.loads(path.read_text())["step"] if path.exists() else None

    def supervisor(self, crash="", **kw):
        kw = {"max_restarts": 10, "crash_loop_limit": 3, "backoff_initial": 0.01,
              "backoff_max": 0.05, "jitter": 0.01, "progress": self.progress, **kw}
        return Supervisor(self.cmd, events=self.events,
                          env={**ENV, "FAKE_CRASH": crash}, **kw)

    def start_driver(self, crash=""):
        return subprocess.Popen([sys.executable, str(self.dir / "driver.py"), str(self.dir), *self.cmd],
                                env={**ENV, "FAKE_CRASH": crash}, stderr=subprocess.PIPE, text=True)

    def finished_bitwise_equal(self):
        state = json.loads((self.dir / "ckpt.json").read_text())
        return state == {"step": self.steps, "value": uninterrupted(self.steps)}

    def kinds(self, kind):
        return [e for e in self.events.read() if e["event"] == kind] if (self.dir / "events.jsonl").exists() else []


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def children_of(proc, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        kids = psutil.Process(proc.pid).children()
        if kids:
            return kids[0]
        time.sleep(0.01)
    raise AssertionError("the supervisor started no child")


# --- in-process supervisor ---------------------------------------------------------------------

def test_clean_run_finishes_without_restarts(run):
    assert run.supervisor().run() == FINISHED
    assert run.finished_bitwise_equal() and run.kinds("restart") == []


@pytest.mark.parametrize("mode, cause", [("exit", "exit code 13"), ("raise", "exit code 1"),
                                         ("kill", "killed by SIGKILL")])
def test_transient_crash_is_restarted_and_the_run_finishes_bitwise_equal(run, mode, cause):
    assert run.supervisor(crash=f"once:7:{mode}").run() == FINISHED
    assert run.finished_bitwise_equal()
    restarts = run.kinds("restart")
    assert [(r["cause"], r["step"], r["restart"]) for r in restarts] == [(cause, 4, 1)]


def test_storage_outages_are_retried_with_backoff_and_never_count_as_a_crash_loop(run):
    assert run.supervisor(crash="outage:4", crash_loop_limit=2).run() == FINISHED
    assert run.finished_bitwise_equal()
    restarts = run.kinds("restart")
    assert [(r["cause"], r["exit_code"]) for r in restarts] == [("storage unavailable", STORAGE_UNAVAILABLE)] * 4
    assert run.kinds("gave_up") == []


def test_an_outage_that_outlasts_max_restarts_exits_retryable_for_the_launcher(run):
    assert run.supervisor(crash="outage:5", max_restarts=2).run() == STORAGE_UNAVAILABLE
    assert len(run.kinds("restart")) == 2 and run.kinds("gave_up") == []


def test_crash_at_the_same_step_every_time_gives_up_naming_step_and_stderr(run, capsys):
    code = run.supervisor(crash="always:7", crash_loop_limit=3).run()
    assert code == GAVE_UP
    # Run 1 committed step 4 (progress), runs 2, 3, 4 did not: three in a row = the limit.
    assert len(run.kinds("restart")) == 3
    [gave_up] = run.kinds("gave_up")
    assert gave_up["step"] == 4 and gave_up["streak"] == 3
    err = capsys.readouterr().err
    message = err[err.index("error: gave up"):]
    assert "gave up at step 4" in message and "3 times in a row" in message
    assert "  | boom at step 7" in message and "exit code 13" in message


def test_a_crash_loop_before_any_checkpoint_says_so_in_plain_words(run, capsys):
    code = run.supervisor(crash="always:1", crash_loop_limit=2).run()
    assert code == GAVE_UP
    err = capsys.readouterr().err
    message = err[err.index("error: gave up"):]
    assert ("gave up at no committed checkpoint: the child crashed 2 times in a row without committing any checkpoint"
            in message)
    assert "newer than no committed checkpoint" not in message
    assert message.rstrip().endswith("it starts from step 0.")


def test_crashes_that_commit_progress_are_restarted_beyond_the_loop_limit(run):
    code = run.supervisor(crash="after_each_checkpoint", crash_loop_limit=2).run()
    assert code == FINISHED
    assert len(run.kinds("restart")) == 2  # after the commits at steps 4 and 8 (12 is the end)
    assert run.finished_bitwise_equal()


def test_max_restarts_bounds_the_total(run, capsys):
    code = run.supervisor(crash="after_each_checkpoint", max_restarts=1).run()
    assert code == GAVE_UP
    assert "--max-restarts 1" in capsys.readouterr().err


def test_an_unreadable_checkpoint_store_does_not_stop_the_supervision(run):
    def broken_store():
        raise ConnectionResetError("connection reset by peer")

    assert run.supervisor(crash="once:7:exit", progress=broken_store).run() == FINISHED
    assert [r["step"] for r in run.kinds("restart")] == [None]


def test_the_progress_probe_finds_the_newest_committed_step_without_torch(tmp_path):
    """`harness train --max-restarts` probes its child's run dir before and after every child: the
    newest committed step, passing over a checkpoint whose files are not all there, with no torch
    imported in the supervisor (and no data read: tests/checkpoint/test_store.py)."""
    import torch

    from harness.checkpoint import CheckpointStore

    store = CheckpointStore(str(tmp_path))
    for step in (1, 2):
        store.save(step, {"model": torch.nn.Linear(4, 4)})
    probe = ("import sys\nfrom harness.process.supervisor import checkpoint_progress\n"
             "print(checkpoint_progress(sys.argv[1])(), 'torch' in sys.modules)")

    def probed() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path)], env=ENV, capture_output=True,
                              text=True, check=True).stdout.splitlines()[-1].split()

    assert probed() == ["2", "False"]
    model = Path(store.ref(2).path) / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-1])
    assert probed() == ["1", "False"]


def test_user_error_is_not_retried(run, capsys):
    assert run.supervisor(crash="user_error").run() == USER_ERROR
    assert run.kinds("restart") == []
    assert "bad config key" in capsys.readouterr().err  # the child's stderr passes through


def test_backoff_grows_exponentially_with_bounded_jitter(run):
    sup = run.supervisor(backoff_initial=1.0, backoff_max=5.0, jitter=0.5)
    for attempt, low in [(1, 1.0), (2, 2.0), (3, 4.0)]:
        assert low <= sup.backoff(attempt) <= low + 0.5
    assert 5.0 <= sup.backoff(9) <= 5.5


def test_describe_exit_and_strip_flags():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(13) == "exit code 13"
    argv = ["train", "c.toml", "--max-restarts", "3", "--crash-loop-limit=2", "--set", "a=1"]
    assert strip_flags(argv, ("--max-restarts", "--crash-loop-limit")) == ["train", "c.toml", "--set", "a=1"]


def test_cli_supervise_runs_the_command_after_the_double_dash(run, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH", "user_error")
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    assert main(["supervise", "--max-restarts", "2", "--", *run.cmd]) == USER_ERROR
    assert "bad config key" in capsys.readouterr().err
    assert main(["supervise"]) == USER_ERROR
    assert "no command to supervise" in capsys.readouterr().err


# --- the supervisor as a real process ----------------------------------------------------------

def test_sigterm_to_the_supervisor_is_forwarded_and_it_exits_preempted(tmp_path):
    run = Run(tmp_path, steps=10_000, every=50)
    sup = run.start_driver()
    child = children_of(sup)
    # Signal only once the child has installed its handlers (it says so on stderr, which the
    # supervisor passes through); earlier, SIGTERM would simply kill it, a different test.
    while "started at step" not in (line := sup.stderr.readline()):
        assert line, "the supervisor exited before its child started"
    time.sleep(0.2)
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=15)
    assert sup.returncode == PREEMPTED, err
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert f"harness[{child.pid}]: received SIGTERM" in err  # the child got it, once
    assert run.progress() > 0 and run.kinds("restart") == []


def test_sigkill_of_the_child_five_times_still_finishes_bitwise_equal(tmp_path):
    run = Run(tmp_path, steps=300, every=10, step_s=0.01)
    sup = run.start_driver()
    rng = random.Random(5)
    killed = set()
    while len(killed) < 5:
        child = children_of(sup)
        if child.pid in killed:
            time.sleep(0.01)
            continue
        time.sleep(rng.uniform(0.05, 0.4))
        child.kill()
        killed.add(child.pid)
    _, err = sup.communicate(timeout=60)
    assert sup.returncode == FINISHED, err
    assert run.finished_bitwise_equal()
    causes = [r["cause"] for r in run.kinds("restart")]
    assert causes.count("killed by SIGKILL") == 5


def test_the_child_dies_with_the_supervisor(tmp_path):
    run = Run(tmp_path, steps=10_000, every=50)
    sup = run.start_driver()
    child = children_of(sup)
    sup.kill()
    sup.communicate(timeout=5)
    child.wait(timeout=5)  # PR_SET_PDEATHSIG: no second writer left behind
