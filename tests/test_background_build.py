"""tests/support/background_build.py: the background build the reward tests wait for."""
from __future__ import annotations

import sys

import pytest

from tests.support.background_build import BackgroundBuild


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_report_is_the_last_stdout_line_and_the_wall_time_stops_with_the_build(tmp_path):
    build = BackgroundBuild.start(_python("import json; print('progress'); print(json.dumps({'steps': 3}))"),
                                  cwd=tmp_path, logs=tmp_path / "logs")
    assert build.report(timeout_s=60) == {"steps": 3}
    wall = build.wall_seconds
    assert wall > 0 and build.wall_seconds == wall
    assert build.report(timeout_s=60) == {"steps": 3}  # waiting again reads the same result


def test_a_failed_build_raises_with_its_exit_status_and_stderr(tmp_path):
    build = BackgroundBuild.start(_python("import sys; sys.stderr.write('no policy here'); sys.exit(3)"),
                                  cwd=tmp_path, logs=tmp_path / "logs")
    with pytest.raises(AssertionError, match=r"exited 3; stderr: no policy here"):
        build.report(timeout_s=60)


def test_a_build_past_its_timeout_is_killed_and_named(tmp_path):
    build = BackgroundBuild.start(_python("import time; time.sleep(60)"), cwd=tmp_path, logs=tmp_path / "logs")
    with pytest.raises(AssertionError, match=r"still ran after 0.2 s"):
        build.report(timeout_s=0.2)
    assert build.process.poll() is not None
