"""Worker processes start under the usual open-files limit however many shared tensors their
arguments hold: one process's descriptors are in flight at a time."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parents[1]


def test_three_workers_of_many_shared_tensors_start_under_a_low_descriptor_limit():
    # 120 shared tensors, each a descriptor in the owner and one more per process in flight:
    # three processes' arguments at once need about 480 under a limit of 400; one at a time, 240
    cmd = [sys.executable, str(TESTS / "fixtures_fds.py"), "400", "120", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started 3" in done.stdout
