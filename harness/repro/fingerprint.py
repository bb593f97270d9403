"""Per-step fingerprints: what a step consumed and produced, cheap enough to record on every step.

A fingerprint record is a JSON object:

    {"step": 14, "loss": 2.7183..., "lr": ..., "batch_hash": "9f86d081884c7d65",
     "state_hash": {"model": "...", "optim": "...", ...}}       (every `every` steps only)

- `loss` is the exact float (JSON round-trips it bit for bit), `lr` whatever the trainer reports.
- `batch_hash`: the digest of the batch's sample ids as little-endian int64 (or of the batch's
  own tensors when it has no ids). Every digest here is xxh3-64 (16 hex digits): a fingerprint
  detects divergence, it does not guard against an adversary, and at about 10 GB/s the state
  hash of a resume costs a few percent of reading the checkpoint (sha256 would double that).
- `state_hash`: one hash per state part over a digest of every tensor and value of the part's
  *live* state, not its state dict: a module's parameters and all buffers, an optimizer's per-parameter
  state (`optimizer.state`) and group hyper-parameters, and for any other part its `state_dict()`.
  Hashing the live optimizer state is deliberate: a buffer that the state dict leaves out still
  changes the hash. It costs one pass over every tensor (a GPU's tensors copied to the host in
  64 MiB batches through pinned memory: checkpoint/device_reads.py), hence the interval. The
  per-tensor digests of the newest hashed step stay in memory (`FingerprintLog.tensors`) so a
  divergence can name the tensor.

`FingerprintLog` is the trainer's state part `fingerprints`: it keeps the history (the newest
`HISTORY_LIMIT` records) in the checkpoint, plus the state hash of the parts at the moment of the
save (in a background save, of the copies staged at that moment, digested by the writer instead
of the step loop: `_StateHashLater`, checkpoint/later.py), without non-persistent buffers: a
checkpoint does not restore them, and a cache that
forward rebuilds before reading it is no divergence (one that carries state is found by
`harness.repro.buffer_probe` and named). After a resume (`watch`) it checks (1) that the restored
parts hash to what was saved, and (2) each re-run step against the record the interrupted
process wrote for that step (read from metrics.jsonl before it is cut back). A mismatch is
reported at once as a `resume_mismatch` event and an error log line, then either stops the run
(`on_divergence="error"`) or goes on.

`differing_fields` and `diagnose` turn two records of one step into the parts that differ and a
hint; `harness verify-resume` and `harness.testing` use them too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import xxhash

from harness.checkpoint.device_reads import device_bytes
from harness.checkpoint.later import Later, Stage, defers
from harness.checkpoint.tensorfile import tensor_bytes
from harness.errors import UserError
from harness.log import get_logger
from harness.repro.buffer_probe import non_persistent_buffers
from harness.repro.on_cores import host_bytes, on_cores
from optim.dtensor import local

log = get_logger(__name__)

HISTORY_LIMIT = 20_000
FIELDS = ("step", "loss", "lr", "batch_hash", "state_hash")
INPUT_FIELDS = ("batch", "lr")  # what `differing_fields` names for a step's inputs

# Parts named first when several differ at once: the model differs as a consequence of almost
# anything, the counters as a consequence of the loss, so they come last.
_PART_ORDER = ("data", "sched", "rng", "optim", "scaler")
_LAST_PARTS = ("trainer", "model")


class ResumeDiverged(UserError):
    """A resumed step differs from the record of the same step before the interruption."""


def digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _tensor_hasher(t: torch.Tensor) -> xxhash.xxh3_64:
    """A tensor's digest before its bytes: its dtype and shape."""
    return xxhash.xxh3_64(f"{t.dtype}{tuple(t.shape)}".encode())


def tensor_digest(t: torch.Tensor) -> str:
    h = _tensor_hasher(t)
    # A DTensor: this rank's shard (FSDP; rank 0 checks). A dense CPU tensor is hashed where it lies, without a copy.
    h.update(tensor_bytes(local(t)))
    return h.hexdigest()


class _FedDigest:
    """`tensor_digest` of a tensor whose staged copy's bytes are fed to it (checkpoint/later.py's `Feed`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._hasher = _tensor_hasher(t)
        self._digest: str | None = None

    def update(self, piece: memoryview) -> None:
        self._hasher.update(piece)

    def finish(self) -> None:
        self._digest = self._hasher.hexdigest()

    def value(self) -> str:
        if self._digest is None:
            raise RuntimeError("a staged tensor's digest was asked for before its bytes were fed")
        return self._digest


def batch_hash(batch: Any) -> str:
    """The hash of a batch: its `sample_ids` when it has them, else of every tensor in it."""
    if isinstance(batch, str):
        return batch
    ids = batch.get("sample_ids") if isinstance(batch, Mapping) else getattr(batch, "sample_ids", None)
    if ids is not None:
        return digest(torch.as_tensor(ids).to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return digest("".join(tensor_digest(t) for t in _tensors(batch)).encode())


def _tensors(node: Any) -> Iterable[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, Mapping):
        for v in node.values():
            yield from _tensors(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _tensors(v)


def _json_digest(value: Any) -> str:
    return digest(json.dumps(value, sort_keys=True, default=repr).encode())


_TensorLeaves = list[tuple[dict[str, str], str, torch.Tensor]]  # (the digests they go to, path, tensor)


def _leaves(node: Any, prefix: str, out: dict[str, str], tensors: _TensorLeaves) -> None:
    """Digest of every JSON value of a state tree into `out`, keyed by its path; its tensors are
    listed in `tensors` as (out, path, tensor), digested together after (`_digest_tensors`)."""
    if isinstance(node, torch.Tensor):
        tensors.append((out, prefix, node))
    elif isinstance(node, Mapping) and node:
        for k, v in node.items():
            _leaves(v, f"{prefix}/{k}" if prefix else str(k), out, tensors)
    elif isinstance(node, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in node):
        for i, v in enumerate(node):
            _leaves(v, f"{prefix}/{i}" if prefix else str(i), out, tensors)
    else:
        out[prefix or "."] = _json_digest(node)


def _digest_tensors(tensors: _TensorLeaves) -> None:
    """Each listed tensor's digest into its `out` at its path: host tensors on every core for a
    large state (on_cores.py: xxhash releases the GIL; a save's step loop waits for this pass), a
    GPU's through two pinned pieces, one device-to-host copy per 64 MiB batch of its tensors
    (checkpoint/device_reads.py)."""
    by_device: dict[torch.device, _TensorLeaves] = {}
    for leaf in tensors:
        by_device.setdefault(local(leaf[2]).device, []).append(leaf)
    for device, leaves in by_device.items():
        if device.type == "cpu":
            values = on_cores(lambda leaf: tensor_digest(leaf[2]), leaves, host_bytes([t for _, _, t in leaves]))
        else:
            hashers = [_tensor_hasher(t) for _, _, t in leaves]
            for index, piece in device_bytes([local(t) for _, _, t in leaves]):
                hashers[index].update(piece)
            values = [h.hexdigest() for h in hashers]
        for (out, path, _), value in zip(leaves, values, strict=True):
            out[path] = value


def _optimizers(part: Any) -> dict[str, torch.optim.Optimizer] | None:
    """The torch optimizers a part consists of (name -> optimizer), or None if it is none."""
    if isinstance(part, torch.optim.Optimizer):
        return {"": part}
    members = getattr(part, "optimizers", None)
    if isinstance(members, Mapping) and members and all(isinstance(o, torch.optim.Optimizer) for o in members.values()):
        return dict(members)
    return None


def _part_leaves(part: Any, names: Mapping[int, str], saved_only: bool,
                 tensors: _TensorLeaves) -> dict[str, str]:
    """Tensor/value path -> digest for one part's live state (see the module docstring), its
    tensors listed in `tensors` and digested later (`_digest_tensors`); `saved_only` leaves out a
    module's non-persistent buffers."""
    out: dict[str, str] = {}
    if isinstance(part, torch.nn.Module):  # non-persistent buffers too, unless saved_only: the step may use them
        buffers = dict(part.named_buffers())
        if saved_only:
            buffers = {k: v for k, v in buffers.items() if k not in non_persistent_buffers(part)}
        _leaves({**dict(part.named_parameters()), **buffers}, "", out, tensors)
        return out
    optimizers = _optimizers(part)
    if optimizers is None:
        _leaves(part.state_dict(), "", out, tensors)
        return out
    for opt_name, opt in optimizers.items():
        base = f"{opt_name}/" if opt_name else ""
        for g, group in enumerate(opt.param_groups):
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            _leaves(hyper, f"{base}param_groups/{g}", out, tensors)
            labels = group.get("param_names") or [names.get(id(p), f"{g}.{i}") for i, p in enumerate(group["params"])]
            for label, p in zip(labels, group["params"], strict=True):
                for key, value in opt.state.get(p, {}).items():
                    _leaves(value, f"{base}state/{label}/{key}", out, tensors)
    return out


def _state_leaves(parts: Mapping[str, Any], saved_only: bool) -> tuple[dict[str, dict[str, str]], _TensorLeaves]:
    """`state_digests` with its tensors listed, not yet digested."""
    param_names = {id(p): n for part in parts.values() if isinstance(part, torch.nn.Module)
                   for n, p in part.named_parameters()}
    tensors: _TensorLeaves = []
    digests = {name: _part_leaves(part, param_names, saved_only, tensors) for name, part in parts.items()}
    return digests, tensors


def state_digests(parts: Mapping[str, Any], saved_only: bool = False) -> dict[str, dict[str, str]]:
    """Part -> (path -> digest) for every part; optimizer state is named by parameter name.
    `saved_only`: what a checkpoint restores, without non-persistent buffers (which forward may
    rebuild before reading; those that carry state are named by harness.repro.buffer_probe instead).
    The tensors of all parts are digested in one pass over the cores (`_digest_tensors`)."""
    digests, tensors = _state_leaves(parts, saved_only)
    _digest_tensors(tensors)
    return digests


class _StateHashLater(Later):
    """A checkpoint's `state_hash` taken from the staged copies of its tensors (checkpoint/later.py):
    the same value as `part_hashes(state_digests(parts, saved_only=True))` at the save, each
    tensor that the save stages read once by its writer, not by the step loop."""

    def __init__(self, parts: Mapping[str, Any]) -> None:
        self._digests, self._tensors = _state_leaves(parts, saved_only=True)
        self._fed: list[tuple[dict[str, str], str, _FedDigest]] = []
        self._bound = False

    def bind(self, stage: Stage) -> None:
        now: _TensorLeaves = []
        for out, path, t in self._tensors:
            fed = _FedDigest(t)
            if stage(t, fed):
                self._fed.append((out, path, fed))
            else:
                now.append((out, path, t))
        _digest_tensors(now)
        self._tensors = []
        self._bound = True

    def value(self) -> dict[str, str]:
        if not self._bound:
            raise RuntimeError("the fingerprints' state hash was deferred and never bound to the snapshot's staging")
        for out, path, fed in self._fed:
            out[path] = fed.value()
        return part_hashes(self._digests)


def part_hashes(digests: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    return {part: digest(json.dumps(sorted(d.items())).encode()) for part, d in digests.items()}


def record(step: int, loss: float, batch: Any, lr: Any, state: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One fingerprint record (see the module docstring)."""
    out = {"step": step, "loss": float(loss), "lr": lr, "batch_hash": batch_hash(batch)}
    if state is not None:
        out["state_hash"] = dict(state)
    return out


def _same_float(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differing_fields(expected: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """What differs between two records of one step: "batch", "lr", "loss", "state:PART".
    A field only one of the two has (a state hash, the lr) is not compared."""
    out = []
    if expected.get("batch_hash") != got.get("batch_hash"):
        out.append("batch")
    if "lr" in expected and "lr" in got and json.dumps(expected["lr"]) != json.dumps(got["lr"]):
        out.append("lr")
    if not _same_float(expected.get("loss"), got.get("loss")):
        out.append("loss")
    a, b = expected.get("state_hash"), got.get("state_hash")
    if a and b:
        out += [f"state:{p}" for p in ordered_parts(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))]
    return out


def ordered_parts(parts: Iterable[str]) -> list[str]:
    parts = set(parts)
    first = [p for p in _PART_ORDER if p in parts]
    last = [p for p in _LAST_PARTS if p in parts]
    return first + sorted(parts - set(first) - set(last)) + last


_HINTS = {
    "data": "the batch differs: the data cursor, sampler or a generator used by the data pipeline is not restored "
            "exactly; register it as a state part, or derive its randomness from the cursor",
    "sched": "the learning rate differs: the LR scheduler is not saved or not restored; register it as a state part",
    "rng": "the loss differs on the same batch from the same state: a random stream (dropout, augmentation) is not "
           "restored; register the RNG state (harness.repro.rng.RNGState) and every torch.Generator the model "
           "draws from",
    "optim": "the optimizer state differs: a buffer (momentum, second moment, step count) is missing from the "
             "optimizer's state_dict or not loaded back",
    "model": "the parameters differ with the same batch, loss and lr: the model or a hidden optimizer/scaler state "
             "is not restored exactly",
    "trainer": "the trainer's counters differ: the step count or loss history is not restored",
}


def unsaved_hint(buffers: list[str]) -> str:
    return (f"non-persistent buffer {', '.join(buffers)} carries state across steps (forward reads it before "
            f"writing it) but no checkpoint holds a non-persistent buffer, so a resumed run starts it from its "
            f"initial value: register it with persistent=True, or rebuild it in forward before reading it")


def diagnose(fields: list[str]) -> tuple[str, str]:
    """(the part to blame, a hint) for the fields that differ at the first divergent step.

    The inputs of a step come before its outputs: a different batch or learning rate explains
    everything after it; then a non-persistent buffer known to carry state ("unsaved:PART.NAME",
    from harness.repro.buffer_probe); a different loss on the same batch and lr means randomness; otherwise
    the first part in `_PART_ORDER` whose state differs after the step.
    """
    restored = [f.split(":", 1)[1] for f in fields if f.startswith("restored:")]
    if restored:
        part = ordered_parts(restored)[0]
        return part, (f"part {part} hashes differently right after loading than when it was saved: its "
                      f"load_state_dict does not put back what its state_dict saved")
    if "batch" in fields:
        return "data", _HINTS["data"]
    if "lr" in fields:
        return "sched", _HINTS["sched"]
    unsaved = [f.split(":", 1)[1] for f in fields if f.startswith("unsaved:")]
    if unsaved:
        return unsaved[0].split(".", 1)[0], unsaved_hint(unsaved)
    if "loss" in fields:
        return "rng", _HINTS["rng"]
    parts = [f.split(":", 1)[1] for f in fields if f.startswith("state:")]
    if not parts:
        return "?", "no field differs"
    part = ordered_parts(parts)[0]
    return part, _HINTS.get(part, f"part {part} differs: its state_dict/load_state_dict does not capture all "
                                  f"of its state")


class FingerprintLog:
    """The `fingerprints` state part: the record history, and the resume checks (module docstring).

    `parts` returns the parts to hash (every registered part but this one); `every` is the
    state-hash interval (0 = only at saves); `on_divergence` is "error" or "warn".
    """

    def __init__(self, parts: Callable[[], Mapping[str, Any]], every: int, on_divergence: str = "warn") -> None:
        self._parts = parts
        self.every = every
        self.on_divergence = on_divergence
        self.records: list[dict[str, Any]] = []
        self.tensors: dict[str, dict[str, str]] = {}
        self._saved_state: dict[str, str] | None = None
        self._expected: dict[int, dict[str, Any]] = {}
        self._events = None
        self._inputs_only = False
        self._unchecked: frozenset[str] = frozenset()
        self.unsaved: list[str] = []  # non-persistent buffers that carry state ("model.ema"), see note_unsaved

    def take(self, step: int, loss: float, batch: Any, lr: Any) -> dict[str, Any]:
        """Record step `step` (after its update) and check it against the pre-interruption record."""
        state = None
        if self.every and step % self.every == 0:
            self.tensors = state_digests(self._parts())
            state = part_hashes(self.tensors)
        rec = record(step, loss, batch, lr, state)
        self.records.append(rec)
        del self.records[:-HISTORY_LIMIT]
        expected = self._expected.pop(step, None)
        if expected is not None:
            fields = differing_fields(expected, rec)
            if self._inputs_only:
                fields = [f for f in fields if f in INPUT_FIELDS]
            fields = [f for f in fields if f.removeprefix("state:") not in self._unchecked]
            if fields:
                self._diverged(step, fields, "a re-run step differs from the record the interrupted process wrote")
        return rec

    def watch(self, events: Any, ran_past: Iterable[Mapping[str, Any]], *, inputs_only: bool = False,
              unchecked: Iterable[str] = ()) -> None:
        """After a resume: check the restored parts against their hash at save time, then expect
        the re-run steps to match `ran_past` (records of steps after the checkpoint that the
        interrupted process logged). `events` gets `resume_mismatch` events. A part whose
        `restored_with_changes` is non-empty is not checked: its load changed the state on
        purpose (the optimizer bundle under a changed config), nor are the `unchecked` parts
        (neither restored nor in the re-run steps' state hashes).
        `inputs_only`: a re-run step is compared on what it consumed (batch, lr) only, where its
        numbers may differ on purpose (a resume at another world size)."""
        self._events = events
        self._inputs_only = inputs_only
        self._unchecked = frozenset(unchecked)
        self._expected = {int(r["step"]): dict(r) for r in ran_past if "batch_hash" in r and "loss" in r}
        if self._saved_state is None:
            return
        parts = self._parts()
        now = part_hashes(state_digests(parts, saved_only=True))
        skip = {name for name, part in parts.items() if getattr(part, "restored_with_changes", None)} | set(unchecked)
        fields = [f"restored:{p}" for p in ordered_parts(p for p in self._saved_state
                                                         if p not in skip and now.get(p) != self._saved_state[p])]
        self._saved_state = None
        if fields:
            step = self.records[-1]["step"] if self.records else 0
            self._diverged(step, fields, "the restored state differs from the state that was saved")

    def note_unsaved(self, buffers: list[str], step: int) -> None:
        """Non-persistent buffers found to carry state (harness.repro.buffer_probe): they take the blame
        for a divergence after a resume, and a resumed process reports them as an event."""
        self.unsaved = list(buffers)
        if self._events is not None:
            self._events.emit("unsaved_buffers", step=step, buffers=self.unsaved, hint=unsaved_hint(self.unsaved))

    def _diverged(self, step: int, fields: list[str], what: str) -> None:
        fields = fields + [f"unsaved:{b}" for b in self.unsaved]
        part, hint = diagnose(fields)
        log.error("resume is not exact", step=step, fields=fields, part=part, hint=hint)
        if self._events is not None:
            self._events.emit("resume_mismatch", step=step, fields=fields, part=part, hint=hint)
        if self.on_divergence == "error":
            raise ResumeDiverged(
                f"step {step} after resuming: {what} ({', '.join(fields)}); part {part}: {hint}. Run `harness "
                f"verify-resume CONFIG` to locate it, or set train.on_divergence = \"warn\" to continue")

    def state_dict(self) -> dict[str, Any]:
        """The history, and the hash of the other parts' saved state now; in a background save
        (`deferring`), the hash of their staged copies, on the writer's thread (`_StateHashLater`)."""
        if defers():
            return {"records": list(self.records), "state_hash": _StateHashLater(self._parts())}
        return {"records": list(self.records), "state_hash": part_hashes(state_digests(self._parts(), saved_only=True))}

    def restore_template(self) -> dict[str, Any]:
        """The state dict's shape without computing its `state_hash` (no tensors either way): what
        a restore matches the checkpoint against (checkpoint/into_live.py, `live_state`)."""
        return {"records": [], "state_hash": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state["records"]]
        self._saved_state = dict(state["state_hash"])


def fingerprint_fields(rec: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields a metrics line adds for a record (`step`, `loss` and `lr` it has already)."""
    return {k: rec[k] for k in ("batch_hash", "state_hash") if rec and k in rec}
