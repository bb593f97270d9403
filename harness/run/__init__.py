"""Running training: one process from start to exit (`process.train`, what `harness train` runs).

process.py      lease, resume, run files and logs, the loop; the exit code
resume.py       which checkpoint to start from (`--resume`), loading it, compatibility checks
elastic.py      a resume (or rollback) at another world size: batch shape, event, random streams
loop.py         the step loop: metrics, evaluation, saves, preemption, `[debug]` fault hooks
cadence.py      when to save (`CheckpointClock`)
files.py        run.json and the one rule for where a run's logs live (`log_dir_for`)
environment.py  the environment recorded with a run and compared on resume

Kept light on purpose (no imports here): `harness.records.run_files` serves the supervisor and
`harness report`, which need no torch.
"""
