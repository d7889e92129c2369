"""The run event log: one file per run, private to the user, and a bounded
number of them however long the session."""

from __future__ import annotations

import os
import stat

from ggufpipe_tui.core.events import Notice
from ggufpipe_tui.session.runlog import RunLog


def test_run_logs_are_private_to_the_user(tmp_path):
    os.umask(0o022)
    runlog = RunLog(tmp_path / "runs")
    runlog.write(Notice("info", "before the first run"))
    runlog.open(0xABC)
    runlog.write(Notice("info", "a prompt may be in here"))
    runlog.close()
    assert runlog.path is not None
    assert stat.S_IMODE(runlog.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700


def test_run_logs_rotate(tmp_path):
    directory = tmp_path / "runs"
    directory.mkdir()
    mine = directory / "notes.txt"  # not a run log: never touched
    mine.write_text("keep me")
    runlog = RunLog(directory, keep=10)
    paths = []
    for run in range(1, 40):
        runlog.open(run)
        runlog.write(Notice("info", f"run {run}"))
        runlog.close()
        assert runlog.path is not None
        paths.append(runlog.path)
    kept = sorted(path for path in directory.iterdir() if path.suffix == ".jsonl")
    assert kept == sorted(paths[-10:]), "the newest ten are kept"
    assert mine.read_text() == "keep me"


def test_run_logs_rotate_by_size_too(tmp_path):
    runlog = RunLog(tmp_path, keep=1000, keep_bytes=64 << 10)
    for run in range(1, 30):
        runlog.open(run)
        runlog.write(Notice("info", "x" * (8 << 10)))
        runlog.close()
    total = sum(path.stat().st_size for path in tmp_path.glob("*.jsonl"))
    assert total <= (64 << 10) + (9 << 10), total
    assert runlog.path is not None and runlog.path.exists(), "the current log is never removed"


def test_a_run_log_directory_others_may_write_in_is_refused(tmp_path):
    import pytest

    shared = tmp_path / "shared-runs"
    shared.mkdir()
    shared.chmod(0o777)
    runlog = RunLog(shared)
    with pytest.raises(
        OSError, match=r"run-log directory .* is writable by its group and others \(mode 0777\)"
    ):
        runlog.open(0x1)
    assert list(shared.iterdir()) == [], "nothing written where others could read or plant files"
    assert "--log-dir" in runlog.disabled
    runlog.write(Notice("info", "still no log"))  # the run goes on without one


def test_a_readable_run_log_directory_is_made_private(tmp_path):
    directory = tmp_path / "runs"
    directory.mkdir()
    directory.chmod(0o755)
    runlog = RunLog(directory)
    runlog.open(0x2)
    runlog.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_run_log_directory_through_a_link_to_another_users_directory_is_refused(tmp_path):
    import pytest

    if os.geteuid() != 0:
        pytest.skip("making a directory of another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    link = tmp_path / "runs"
    link.symlink_to(theirs)
    with pytest.raises(OSError, match="belongs to uid 65534"):
        RunLog(link).open(0x3)
