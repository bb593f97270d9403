"""The exit codes of `harness train` and `harness supervise`: what a launcher may rely on.

| code | name                   | meaning                                                    | launcher should |
|------|------------------------|------------------------------------------------------------|-----------------|
| 0    | FINISHED               | the run reached its last step; the final checkpoint is committed | stop      |
| 2    | USER_ERROR             | bad config, missing file, incompatible checkpoint (`UserError`)  | stop, fix |
| 3    | GAVE_UP                | the supervisor saw a crash loop or hit --max-restarts     | stop, read the error |
| 75   | PREEMPTED              | a stop signal was honoured: checkpoint committed, then exit | requeue   |
| 76   | SAVE_DEADLINE_MISSED   | a stop signal arrived but the save overran its deadline;  | requeue   |
|      |                        | the previous checkpoint is still the newest good one       |                 |
| any other | (crash)           | a bug or an infrastructure failure                         | restart (the supervisor does) |

75 is EX_TEMPFAIL from sysexits.h: "try again later", the conventional "safe to requeue".

SAVE_DEADLINE_MISSED is kept apart from PREEMPTED although both mean "requeue": a run that keeps
missing its deadline loses every step since its previous checkpoint at each preemption, and the
fix (a longer grace period, or a larger deadline) is only found if the exit code says so.
Launchers treat the two alike through `REQUEUE`.
"""

FINISHED = 0
USER_ERROR = 2
GAVE_UP = 3
PREEMPTED = 75
SAVE_DEADLINE_MISSED = 76

# Exit codes after which the run is consistent on storage and simply has to be started again.
REQUEUE = frozenset({PREEMPTED, SAVE_DEADLINE_MISSED})

NAMES = {
    FINISHED: "finished",
    USER_ERROR: "user_error",
    GAVE_UP: "gave_up",
    PREEMPTED: "preempted",
    SAVE_DEADLINE_MISSED: "save_deadline_missed",
}
