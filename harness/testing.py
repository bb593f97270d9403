"""Resume-equivalence checks for your own training code, in a few lines of pytest.

    from harness.testing import Task, assert_resumes_exactly

    def build() -> Task:
        model = MyModel()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return Task(model=model, optimizer=opt, data=MyBatches(seed=0),
                    loss_fn=lambda m, batch: m(batch.x, batch.y))

    def test_my_training_resumes_exactly():
        assert_resumes_exactly(build, steps=12, interrupt_at=[4, 9])

`check_resume(build, ...)` runs the task continuously (A) and with interruptions (B), in this
process. An interruption is what a restart does: the state parts are saved into a scratch folder
by the saver `harness train` uses (`harness.checkpoint.open_saver`, saving in the background as
it does by default), every object is dropped, the process RNGs are re-seeded, `build()` makes
everything anew, the checkpoint is loaded into it by the same loader (`harness.checkpoint.load`)
and training continues. Every step is fingerprinted (`harness.repro.fingerprint`: loss, batch
hash, lr, hash of every part's live state), B's steps are compared with A's, and right after
each load the restored parts are compared with what was saved. At the first difference both
runs are checkpointed at that step and compared tensor by tensor (`harness.checkpoint.diff`) to
name the tensor and its max difference. Before training, the completeness check
(`harness.repro.completeness`) refuses a task with stateful objects (an extra optimizer, a
scheduler, a generator, ...) that are not parts, and after the first step of each build one
whose model keeps state in a non-persistent buffer (`harness.repro.buffer_probe`); with
`unregistered="warn"` such a buffer takes the blame.

What a checkpoint holds is `Task.state`; by default the model (`model`), the optimizer(s)
(`optim`, `optim1`, ...), the scheduler(s) (`sched`, ...), the data iterator when it has
`state_dict`/`load_state_dict` (`data`), the grad scaler (`scaler`) and the process RNGs (`rng`).
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.checkpoint import CheckpointStore, Saver, load, open_saver
from harness.checkpoint.diff import compare_checkpoints
from harness.repro.buffer_probe import BufferProbe, non_persistent_buffers
from harness.repro.completeness import check_buffers, check_registered
from harness.repro.fingerprint import FingerprintLog, diagnose, part_hashes, record, state_digests
from harness.repro.rng import RNGState, seed_everything
from harness.verify.resume_equivalence import Verdict, blame, describe_fields, first_divergence

_OPTIM_HINT = "an optimizer buffer (momentum, second moment) must be in the optimizer's state_dict"


def _listed(x: Any) -> list[Any]:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class Task:
    """One training setup, made anew by the user's `build()` for every (re)start.

    `model`; `optimizer`: a torch optimizer, a MultiOpt or a list; `data`: an iterator of batches;
    `loss_fn(model, batch) -> loss tensor` (default: `model(batch)` returns the loss);
    `scheduler`: an LR scheduler, a MultiSched, a list or None; `scaler`: a GradScaler or None;
    `state`: the parts a checkpoint holds (default: see the module docstring); `step`: a custom
    training step that returns `(loss, batch)` (the batch or its hash) instead of the default
    forward/backward/step/zero_grad; `extras`: other objects the training code uses, for the
    completeness check; `close`: called when the task is thrown away."""

    model: torch.nn.Module
    optimizer: Any
    data: Iterator[Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    state: Mapping[str, Any] | None = None
    step: Callable[[], tuple[float, Any]] | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    close: Callable[[], None] | None = None

    def parts(self) -> dict[str, Any]:
        if self.state is not None:
            return dict(self.state)
        parts: dict[str, Any] = {"model": self.model}
        for kind, objects in (("optim", _listed(self.optimizer)), ("sched", _listed(self.scheduler))):
            parts.update({kind if i == 0 else f"{kind}{i}": o for i, o in enumerate(objects)})
        if callable(getattr(self.data, "state_dict", None)) and callable(getattr(self.data, "load_state_dict", None)):
            parts["data"] = self.data
        if self.scaler is not None:
            parts["scaler"] = self.scaler
        # The GPU stream saved is the one of the model's device: the one its dropout draws from.
        parts["rng"] = RNGState(next((p.device for p in self.model.parameters()), torch.device("cpu")))
        return parts

    def run_step(self) -> tuple[float, Any]:
        if self.step is not None:
            return self.step()
        batch = next(self.data)
        self.model.train()
        loss = self.loss_fn(self.model, batch) if self.loss_fn else self.model(batch)
        optimizers = _listed(self.optimizer)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            for opt in optimizers:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            loss.backward()
            for opt in optimizers:
                opt.step()
        for sched in _listed(self.scheduler):
            sched.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return float(loss.detach()), batch

    def lr(self) -> list[float]:
        return [float(g["lr"]) for opt in _listed(self.optimizer) for g in opt.param_groups]


class _Run:
    """One run (A or B) of a task: builds, steps, fingerprints, saves and restores."""

    def __init__(self, build: Callable[[], Task], seed: int, every: int, store: CheckpointStore,
                 unregistered: str) -> None:
        self.build, self.seed, self.every, self.store, self.unregistered = build, seed, every, store, unregistered
        self.saver: Saver | None = None
        self.task: Task | None = None
        self.step = 0
        self.records: list[dict[str, Any]] = []
        self.tensors: dict[int, dict[str, dict[str, str]]] = {}
        self.probe: BufferProbe | None = None
        self.unsaved: list[str] = []

    def start(self) -> None:
        seed_everything(self.seed)
        self.task = self.build()
        self.saver = open_saver(self.store)  # in the background; one per (re)start, as each process opens its own
        check_registered({"task": self.task}, self.task.parts(), self.unregistered)
        self.probe = BufferProbe(self.task.model) if non_persistent_buffers(self.task.model) else None

    def parts(self) -> dict[str, Any]:
        # The trainer's own fingerprint history is not hashed: it is compared here directly.
        assert self.task is not None, "between start() and stop()"
        return {k: v for k, v in self.task.parts().items() if not isinstance(v, FingerprintLog)}

    def advance(self) -> dict[str, Any]:
        assert self.task is not None, "between start() and stop()"
        loss, batch = self.task.run_step()
        if self.probe is not None and self.probe.done:  # non-persistent buffers that carry state
            self.unsaved = self.probe.stateful
            self.probe = None
            check_buffers(self.unsaved, self.unregistered)
        self.step += 1
        state = None
        if self.every and self.step % self.every == 0:
            self.tensors[self.step] = state_digests(self.parts())
            state = part_hashes(self.tensors[self.step])
        rec = record(self.step, loss, batch, self.task.lr(), state)
        self.records.append(rec)
        return rec

    def save(self) -> dict[str, dict[str, str]]:
        """Checkpoint the current step, committed before it returns; returns the digests of what it
        saved (no non-persistent buffers)."""
        assert self.task is not None and self.saver is not None, "between start() and stop()"
        self.saver.save(self.step, self.task.parts())
        self.saver.finish()
        return state_digests(self.parts(), saved_only=True)

    def restart(self) -> tuple[list[str], dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """Save, drop everything, rebuild, load. Returns (parts that differ after loading, digests
        at save, digests after load)."""
        saved = self.save()
        self.stop()
        self.start()
        assert self.task is not None, "start() built it"
        load(self.store, self.store.ref(self.step), self.task.parts())
        loaded = state_digests(self.parts(), saved_only=True)
        return [p for p in saved if saved[p] != loaded.get(p)], saved, loaded

    def stop(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self.saver = None  # its staging buffers hold a copy of the state
        if self.task is not None and self.task.close is not None:
            self.task.close()
        self.task = None
        gc.collect()


def check_resume(build: Callable[[], Task], *, steps: int = 20, interrupt_at: list[int] | tuple[int, ...] = (7, 13),
                 seed: int = 0, fingerprint_every: int = 1, unregistered: str = "error",
                 workdir: str | Path | None = None) -> Verdict:
    """Run `build()`'s task for `steps` steps continuously and with restarts after the steps in
    `interrupt_at`; the verdict is identical, or names the first divergent step, the part, the
    tensor and a hint (see the module docstring). `unregistered` is the completeness policy
    ("error" raises `IncompleteState`, "warn" logs). Checkpoints go to `workdir` (default: a
    temporary folder)."""
    points = sorted(set(interrupt_at))
    if points and (points[0] < 1 or points[-1] >= steps):
        raise ValueError(f"interrupt_at {points}: steps must lie in 1..{steps - 1}")
    with tempfile.TemporaryDirectory(prefix="check-resume-", dir=workdir) as tmp:
        run_a = _Run(build, seed, fingerprint_every, CheckpointStore(f"{tmp}/A"), unregistered)
        run_a.start()
        for _ in range(steps):
            run_a.advance()
        run_a.save()
        run_a.stop()

        run_b = _Run(build, seed, fingerprint_every, CheckpointStore(f"{tmp}/B"), unregistered)
        run_b.start()
        verdict = Verdict(identical=False, steps=steps, interrupt_at=points)
        while run_b.step < steps:
            if run_b.step in points:
                differ, saved, loaded = run_b.restart()
                if differ:
                    return _restore_verdict(verdict, run_b, differ, saved, loaded)
            rec = run_b.advance()
            found = first_divergence([run_a.records[rec["step"] - 1]], [rec])
            if found is not None:
                return _step_verdict(verdict, build, seed, fingerprint_every, tmp, run_a, run_b, found)
        run_b.save()
        run_b.stop()
        final = compare_checkpoints((run_a.store, run_a.store.ref(steps)), (run_b.store, run_b.store.ref(steps)))
        if final.equal:
            verdict.identical = True
            return verdict
        verdict.when = "final"
        verdict.part = final.differences[0].part
        verdict.fields = [f"state:{verdict.part}"]
        verdict.tensor, verdict.max_diff = blame(final.differences, verdict.part)
        verdict.hint = "every step matches, only the final checkpoints differ: a part does not save all of its state"
        verdict.details += [d.line for d in final.differences[:8]]
        return verdict


def _first_tensor(a: Mapping[str, str], b: Mapping[str, str]) -> str | None:
    return next((k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)), None)


def _restore_verdict(verdict: Verdict, run: _Run, differ: list[str], saved, loaded) -> Verdict:
    verdict.step, verdict.when = run.step, "restore"
    verdict.fields = [f"restored:{p}" for p in differ]
    verdict.part, verdict.hint = diagnose(verdict.fields)
    verdict.tensor = _first_tensor(saved[verdict.part], loaded.get(verdict.part, {}))
    only = ("only before saving" if verdict.tensor not in loaded.get(verdict.part, {}) else
            "only after loading" if verdict.tensor not in saved[verdict.part] else "different")
    verdict.details.append(f"{verdict.part}/{verdict.tensor}: {only}")
    if only == "only before saving":
        verdict.hint = (f"{verdict.part} uses {verdict.tensor} but its state_dict leaves it out, so a restart loses it"
                        + ("; " + _OPTIM_HINT if verdict.part.startswith("optim") else ""))
    run.stop()
    return verdict


def _step_verdict(verdict: Verdict, build, seed: int, every: int, tmp: str, run_a: _Run, run_b: _Run,
                  found: tuple[int, list[str]]) -> Verdict:
    """Both runs at the divergent step, checkpointed and compared, name the tensor."""
    step, fields = found
    verdict.step, verdict.fields = step, fields + [f"unsaved:{name}" for name in run_b.unsaved]
    verdict.part, verdict.hint = diagnose(verdict.fields)
    verdict.details += describe_fields(step, fields, run_a.records[step - 1], run_b.records[-1])
    run_b.save()
    digests_b = run_b.tensors.get(step, {})
    run_b.stop()
    replay = _Run(build, seed, every, CheckpointStore(f"{tmp}/A-replay"), "warn")
    replay.start()
    for _ in range(step):
        replay.advance()
    replay.save()
    replay.stop()
    diff = compare_checkpoints((replay.store, replay.store.ref(step)), (run_b.store, run_b.store.ref(step)))
    prefer = _first_tensor(run_a.tensors.get(step, {}).get(verdict.part, {}), digests_b.get(verdict.part, {}))
    verdict.tensor, verdict.max_diff = blame(diff.differences, verdict.part, prefer)
    if verdict.tensor is None and prefer:
        verdict.tensor = prefer
    if run_b.unsaved:  # in no checkpoint, so no difference there names it
        verdict.tensor, verdict.max_diff = run_b.unsaved[0], None
    if diff.differences:
        verdict.details.append(f"checkpoints at step {step} differ (first differences):")
        verdict.details += [f"  {d.line}" for d in diff.differences[:8]]
    return verdict


def assert_resumes_exactly(build: Callable[[], Task], **kwargs: Any) -> Verdict:
    """`check_resume(build, **kwargs)`, raising AssertionError with the verdict unless identical."""
    verdict = check_resume(build, **kwargs)
    if not verdict:
        raise AssertionError(str(verdict))
    return verdict


def trainer_task(cfg: Any) -> Task:
    """The built-in trainer for a `RunConfig` as a Task (its own parts, its own step)."""
    from harness.run.trainer import Trainer

    trainer = Trainer(cfg, fresh=True)  # a restore into it replaces what model.init_from loaded

    def step() -> tuple[float, Any]:
        result = trainer.train_step()
        assert result.fingerprint is not None  # train_step records every step's
        return result.loss, result.fingerprint["batch_hash"]

    return Task(model=trainer.model, optimizer=trainer.optim, data=trainer.stream, scheduler=trainer.sched,
                scaler=trainer.scaler, state=trainer.state.parts(), step=step, extras={"trainer": trainer},
                close=trainer.close)
