"""Running training: one process from start to exit (`session.train`, what `harness train` runs).

session.py      lease, resume, run files and logs, the loop; the exit code
resume.py       which checkpoint to start from (`--resume`), loading it, compatibility checks
elastic.py      a resume (or rollback) at another world size: batch shape, event, random streams
loop.py         the step loop: metrics, evaluation, saves, preemption, `[debug]` fault hooks
rollback.py     back to the newest good checkpoint before an anomaly, past its batches
trainer.py      the Trainer: one step (forward, backward, accumulation, clipping), evaluation
state.py        the named state parts a checkpoint holds
cadence.py      when to save (`CheckpointClock`)
environment.py  the environment recorded with a run and compared on resume

Kept light on purpose (no imports here): importing `harness.run.session` must not pull in the
trainer's torch-heavy modules before the numerics settings are made.
"""
