"""The health tests compare finished runs with an uninterrupted one of the same tiny config."""

import pytest

from procs import TINY, harness


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    """tiny.toml run once, uninterrupted, at world size 1."""
    run_dir = tmp_path_factory.mktemp("continuous") / "run"
    harness("train", str(TINY), "--run-dir", str(run_dir), check=True)
    return run_dir
