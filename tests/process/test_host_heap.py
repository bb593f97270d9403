"""`train.host_heap`: with "keep", memory the process frees is reused without faulting its pages in
again; with "system", glibc hands a large freed block back to the kernel. Measured in fresh
processes, by their own minor-fault counts."""

import platform
import subprocess
import sys

import pytest

# Each round allocates, writes and frees 48 MiB: over glibc's largest mmap threshold (32 MiB).
ROUNDS = """
import resource, sys, torch
from harness.process import host_heap
held = host_heap.apply(sys.argv[1])
for _ in range(3):  # the heap settles: a freed block may not fit the next aligned request at once
    torch.ones(12 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(12 * 2**20)
print(held, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def rounds(setting: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, setting], check=True, capture_output=True, text=True)
    held, faults = out.stdout.split()
    return held, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the kept heap is glibc's mallopt")
def test_a_kept_heap_reuses_freed_memory_without_faults():
    kept, system = rounds("keep"), rounds("system")
    assert kept[0] == "keep" and system[0] == "system"
    # 12,288 pages a round when returned (fewer with transparent huge pages); none when kept.
    assert system[1] >= 5 * 12 * 2**20 * 4 // 2**21
    assert kept[1] * 10 < system[1], (kept, system)
