"""writer_cores.py: background checkpoint jobs run on the cores placed for them (and so do the
threads they start), `auto` takes the cores the training threads leave, those taking the most
device interrupts first, and a core this process may not use is refused in one line."""

from __future__ import annotations

import os
import re
import threading

import pytest

from harness.checkpoint.save import writer_cores
from harness.checkpoint.save.background import BackgroundJob
from harness.errors import UserError
from harness.topology import process_cores

# This project's VM: the disk's completions (virtio1-req.0) all on CPU1.
INTERRUPTS = """\
           CPU0       CPU1
 24:          1          0  IO-APIC   5-edge      ACPI:Ged
 32:      16512          0 PCI-MSIX-0000:00:01.0   4-edge      virtio0-reporting_vq
 36:          0    9231399 PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0
 39:     168594          0 PCI-MSIX-0000:00:03.0   2-edge      virtio2-output.0
NMI:          0          0   Non-maskable interrupts
LOC:   11846155   12861614   Local timer interrupts
CAL:    4380148    2881318   Function call interrupts
ERR:          0
"""


@pytest.fixture(autouse=True)
def no_placement_after():
    yield
    writer_cores.place_writers("any", 0)


def test_device_interrupts_count_numbered_lines_only():
    assert writer_cores.device_interrupts(INTERRUPTS) == {0: 1 + 16512 + 168594, 1: 9231399}
    assert writer_cores.device_interrupts("") == {}


def test_free_cores_are_those_the_training_threads_leave_most_interrupted_first():
    counts = {0: 10, 1: 500, 2: 0, 3: 500}
    assert writer_cores.free_cores([0, 1, 2, 3], 2, counts) == {1, 3}
    assert writer_cores.free_cores([0, 1, 2, 3], 3, counts) == {3}  # a tie: the higher-numbered core
    assert writer_cores.free_cores([0, 1, 2, 3], 1, {}) == {1, 2, 3}
    assert writer_cores.free_cores([0, 1], 2, counts) is None
    assert writer_cores.free_cores([0, 1], 4, counts) is None


def test_auto_reads_the_machines_interrupts(tmp_path, monkeypatch):
    cores = process_cores()
    table = tmp_path / "interrupts"
    table.write_text(" ".join(f"CPU{c}" for c in cores) + "\n 36: " + " ".join(
        "7" if c == cores[0] else "0" for c in cores) + " virtio1-req.0\n")
    monkeypatch.setattr(writer_cores, "INTERRUPTS", table)
    assert writer_cores.place_writers("auto", len(cores)) is None
    if len(cores) > 1:
        assert writer_cores.place_writers("auto", len(cores) - 1) == {cores[0]}
    monkeypatch.setattr(writer_cores, "INTERRUPTS", tmp_path / "absent")  # no table: the highest-numbered cores
    assert writer_cores.place_writers("auto", 0) == set(cores)


def where_a_job_runs() -> tuple[set[int], set[int]]:
    """The cores a background job's thread may run on, and those of a thread it starts."""
    seen: dict[str, set[int]] = {}

    def job_body() -> None:
        seen["job"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
        child.start()
        child.join()

    job = BackgroundJob("test-job", "the test job", failed=lambda step, e: e)
    job.start(1, job_body)
    job.finish(timeout=30)
    return seen["job"], seen["child"]


def test_a_job_and_the_threads_it_starts_run_on_the_placed_cores():
    cores = process_cores()
    last = cores[-1]
    assert writer_cores.place_writers([last], 1) == {last}
    assert where_a_job_runs() == ({last}, {last})
    assert os.sched_getaffinity(0) == set(cores)  # the owner's thread is left alone
    assert writer_cores.place_writers("any", 1) is None
    assert where_a_job_runs() == (set(cores), set(cores))


def test_a_core_this_process_may_not_use_is_refused_naming_it():
    cores = process_cores()
    with pytest.raises(UserError, match=re.escape(f"writer_cores names core(s) [4096] this process may not run on "
                                                  f"(it may run on {cores})")):
        writer_cores.place_writers([cores[0], 4096], 1)


def test_a_refused_placement_warns_and_the_job_still_runs(monkeypatch):
    writer_cores.place_writers(process_cores(), 1)

    def refuse(_pid: int, _cores: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    ran = []
    job = BackgroundJob("test-job", "the test job", failed=lambda step, e: e)
    job.start(1, lambda: ran.append(True))
    job.finish(timeout=30)
    assert ran == [True]
