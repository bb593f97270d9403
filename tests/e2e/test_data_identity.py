"""The data is part of the run's math: a resume with another data file, or the same file with
other content, is refused like a changed config key (real `harness train` processes)."""

import shutil

from harness.data.corpus import default_corpus
from procs import TINY, assert_one_line_error, harness, kill_at_step


def test_other_data_on_resume_is_refused_unless_allowed(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(default_corpus()[:48 * 1024])
    run = tmp_path / "run"
    args = ["train", str(TINY), "--run-dir", str(run)]
    # A save inside the step loop: the step-4 checkpoint is there when the kill comes.
    assert kill_at_step([*args, "--set", f"data.url='{text}'", "--set", "checkpoint.async_save=false"], run, 6) != 0

    moved = tmp_path / "moved.txt"
    shutil.copy(text, moved)
    other_url = harness(*args, "--set", f"data.url='{moved}'")
    assert_one_line_error(other_url, "data.url differ from the checkpoint")

    text.write_bytes(default_corpus()[-48 * 1024:])  # same file name and size, other content
    replaced = harness(*args, "--set", f"data.url='{text}'")
    assert_one_line_error(replaced, "data content differ")

    allowed = harness(*args, "--set", f"data.url='{text}'", "--allow-config-change", check=True)
    assert "resuming with a changed config" in allowed.stderr and "data content" in allowed.stderr
