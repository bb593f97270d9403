"""`harness torture` takes storage options as `-o KEY=VALUE` like every other
command (it took one JSON string, `--storage-options`)."""

import pytest

from harness.cli import main


def test_torture_takes_dash_o_storage_options(s3_server, s3_url, capsys):
    code = main(["torture", s3_url, "--points", "2", "--modes", "eio", "-o", f"endpoint_url={s3_server.endpoint}",
                 "-o", "retry.attempts=3", "-o", "retry.deadline_s=20"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "s3       eio             2         2     0" in out


def test_the_json_flag_is_gone(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["torture", "memory://x", "--storage-options", '{"endpoint_url": "http://127.0.0.1:1"}'])
    assert exit_.value.code == 2 and "unrecognized arguments: --storage-options" in capsys.readouterr().err
