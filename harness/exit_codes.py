"""The exit codes of `harness train` and `harness supervise`: what a launcher may rely on.

| code | name                   | meaning                                                    | launcher should |
|------|------------------------|------------------------------------------------------------|-----------------|
| 0    | FINISHED               | the run reached its last step; the final checkpoint is committed | stop      |
| 2    | USER_ERROR             | bad config, missing file, incompatible checkpoint (`UserError`)  | stop, fix |
| 3    | GAVE_UP                | the supervisor saw a crash loop or hit --max-restarts     | stop, read the error |
| 69   | STORAGE_UNAVAILABLE    | the storage endpoint did not answer within the retry      | retry with backoff |
|      |                        | deadline (named with the operation in the error line)     |                 |
| 75   | PREEMPTED              | a stop signal was honoured: checkpoint committed, then exit | requeue   |
| 76   | SAVE_DEADLINE_MISSED   | a stop signal arrived but the save overran its deadline;  | requeue   |
|      |                        | the previous checkpoint is still the newest good one       |                 |
| 79   | HUNG                   | the hang watchdog saw a step, save or collective pass its | restart, bounded |
|      |                        | limit; stacks dumped to the log dir (harness/health)       | (as a crash)    |
| any other | (crash)           | a bug or an infrastructure failure                         | restart (the    |
|      |                        |                                                            | supervisor does) |

75 is EX_TEMPFAIL from sysexits.h: "try again later", the conventional "safe to requeue".

SAVE_DEADLINE_MISSED is kept apart from PREEMPTED although both mean "requeue": a run that keeps
missing its deadline loses every step since its previous checkpoint at each preemption, and the
fix (a longer grace period, or a larger deadline) is only found if the exit code says so.
Launchers treat the two alike through `REQUEUE`.

STORAGE_UNAVAILABLE is 69, EX_UNAVAILABLE from sysexits.h ("a service is unavailable"). It is a
third kind: not a crash (restarting at once would only hammer an endpoint that is down) and not a
user error (exit 2 tells a launcher "do not retry", which would end a week-long job over a
minute's outage). Every launcher retries it after a backoff (`RETRY_LATER`); the checkpoint
commit is atomic and the lease is left for the next attempt, so nothing is lost.

HUNG is 79, outside sysexits.h's range (64-78) so it means one thing only. A hang is most often
the infrastructure's (a dead mount, a lost peer, a bad node): restarting from the last checkpoint
is the remedy, as for a crash, and like a crash it is bounded: the supervisor counts it toward
its crash-loop limit, torchrun toward --max-restarts, the k8s Job toward backoffLimit, and the
SLURM script requeues it at most HANG_REQUEUES times (a requeue may land on other nodes).

`record(code)`: when `HARNESS_EXIT_CODE_DIR` is set (ops/torchrun/train.sh sets it), the process
writes its exit code to `restart-R.rank-N` there, so a launcher can learn the trainers' codes
through torchrun, which reports any failed worker group as its own exit 1.

`earlier_stop()`: torchrun restarts the worker group after any failed worker, up to
`--max-restarts`, and cannot be told that 2 and 3 (`STOP`) are not to be retried. A restarted
worker therefore reads what the earlier attempts of its group recorded and, when one of them
stopped, exits with that code at once (the CLI, before it reads the config): the error is
printed once, and a run stopped on an anomaly is not trained on past it. The restarts torchrun
still makes cost one Python start each. torchrun keeps its restarts because they are what
regroups an elastic group after a lost node: an agent that gives up closes the rendezvous, and a
torchrun started again by a script could not join it.
"""

import os
import re
from pathlib import Path

FINISHED = 0
USER_ERROR = 2
GAVE_UP = 3
PREEMPTED = 75
SAVE_DEADLINE_MISSED = 76
STORAGE_UNAVAILABLE = 69
# What `debug.crash_at_step` dies with (os._exit, no cleanup): a crash the supervisor restarts.
CRASH_EXIT_CODE = 13
HUNG = 79

# Exit codes after which the run is consistent on storage and simply has to be started again.
REQUEUE = frozenset({PREEMPTED, SAVE_DEADLINE_MISSED})
# Exit codes of an infrastructure outage: start again after a backoff.
RETRY_LATER = frozenset({STORAGE_UNAVAILABLE})
# Exit codes after which the same command started again cannot do better: stop (user error first).
STOP = (USER_ERROR, GAVE_UP)
EXIT_CODE_DIR_ENV = "HARNESS_EXIT_CODE_DIR"
_RECORD_NAME = re.compile(r"restart-(\d+)\.rank-\d+")

NAMES = {
    FINISHED: "finished",
    USER_ERROR: "user_error",
    GAVE_UP: "gave_up",
    PREEMPTED: "preempted",
    SAVE_DEADLINE_MISSED: "save_deadline_missed",
    STORAGE_UNAVAILABLE: "storage_unavailable",
    HUNG: "hung",
}


def record(code: int) -> None:
    """Write `code` to `$HARNESS_EXIT_CODE_DIR/restart-R.rank-N` (R: torchrun's restart count, N:
    the global rank) when that variable is set; see the module docstring."""
    folder = os.environ.get(EXIT_CODE_DIR_ENV)
    if not folder:
        return
    name = f"restart-{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))}.rank-{int(os.environ.get('RANK', 0))}"
    try:
        (Path(folder) / name).write_text(f"{code}\n")
    except OSError:
        pass  # the launcher then sees no code for this rank and treats the exit as a crash


def earlier_stop() -> int | None:
    """The `STOP` code that a process of an earlier attempt of this torchrun worker group (a
    lower `TORCHELASTIC_RESTART_COUNT`) recorded in `$HARNESS_EXIT_CODE_DIR`, or None (also when
    the variable is not set, or in the first attempt); see the module docstring."""
    folder = os.environ.get(EXIT_CODE_DIR_ENV)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not folder or restart == 0:
        return None
    codes = set()
    for path in Path(folder).glob("restart-*.rank-*"):
        match = _RECORD_NAME.fullmatch(path.name)
        if match and int(match[1]) < restart:
            try:
                codes.add(int(path.read_text()))
            except (OSError, ValueError):
                continue  # a rank killed while writing its record: no code, as for a crash
    return next((code for code in STOP if code in codes), None)
