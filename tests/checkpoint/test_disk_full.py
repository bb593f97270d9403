"""A save that runs out of disk: a real 1 MiB tmpfs when this machine lets us mount one (CI runs
as root), and the injected ENOSPC everywhere."""

from __future__ import annotations

import errno

import pytest
import torch

from harness.checkpoint import CheckpointStore
from harness.checkpoint.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("quiet_logs")  # tests/conftest.py


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((100_000,), float(step))}, "trainer": {"step": step}}  # 400 kB


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs(1024)


def _check_failed_save(store: CheckpointStore, exc: BaseException) -> None:
    errnos = {getattr(e, "errno", None) for e in (exc, exc.__cause__, exc.__context__)}
    assert errno.ENOSPC in errnos, f"{type(exc).__name__}: {exc}"
    good = store.latest_good()
    assert good is not None and good.step == 2 and not store.verify(good)
    assert not store.incomplete(), "a half-written checkpoint folder was left behind"


def test_real_full_disk(small_disk):
    store = CheckpointStore(str(small_disk / "run"), keep_last=2)
    with store.lease():
        store.save(1, _state(1))
        store.save(2, _state(2))
        with pytest.raises((OSError, CheckpointError)) as e:
            store.save(3, _state(3))                 # two checkpoints fill the disk
        _check_failed_save(store, e.value)
        store.delete(store.ref(1))                   # space comes back: saving works again
        store.save(3, _state(3))
    assert [r.step for r in store.list()] == [2, 3]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_injected_enospc_at_every_write(tmp_path, where):
    url = str(tmp_path / "run") if where == "local" else f"memory://disk-full-{tmp_path.name}"
    count = CheckpointStore(url + "-count", keep_last=2, storage_options={"faults": "count"})
    count.save(3, _state(3))
    writes = [n for n, op, _ in count.loc.fs.injector.trace if op in ("write", "put", "fsync")]
    for at in writes:
        run = f"{url}-{at}"
        CheckpointStore(run, keep_last=2).save(1, _state(1))
        CheckpointStore(run, keep_last=2).save(2, _state(2))
        store = CheckpointStore(run, keep_last=2, storage_options={"faults": f"enospc@{at}"})
        with pytest.raises((OSError, CheckpointError)) as e:
            store.save(3, _state(3))
        clean = CheckpointStore(run, keep_last=2)
        good = clean.latest_good()
        assert errno.ENOSPC in {getattr(x, "errno", None) for x in (e.value, e.value.__cause__, e.value.__context__)}
        # memory:// makes an object visible at open, so a failed final "put" of the manifest can
        # leave a complete step 3: also fine. The previous checkpoint must be intact either way.
        assert good is not None and good.step in (2, 3) and not clean.verify(good)
        assert not clean.verify(clean.ref(2))
        if where == "local":                         # object stores have no temporary folder to clean
            assert not clean.incomplete()
