"""`learner.return_freed_memory`: with glibc's mmap threshold fixed, blocks a process frees go
back to the OS at once; without it, once a large block has been freed, later blocks live on the
C heap and freed ones between live ones stay in the process (the peak RSS per response token of
SmolLM2 with checkpointing was mostly this: docs/learner.md)."""

import subprocess
import sys

import pytest

from cadence.config import load_config

SCRIPT = """
import sys, torch
from cadence.learner.allocator import return_freed_memory
if sys.argv[1] == "1":
    assert return_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(4 << 20); del big  # a 16 MiB block freed: glibc's threshold rises to it
blocks = [torch.ones(1 << 19) for _ in range(64)]  # 64 x 2 MiB, as a learner's activations
held = rss()
del blocks[::2]  # every other one freed, between live ones
print((held - rss()) >> 20)
"""


def _returned_mib(option: bool) -> int:
    cmd = [sys.executable, "-c", SCRIPT, "1" if option else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_go_back_to_the_os_with_the_option_and_stay_without():
    assert _returned_mib(True) >= 56  # of the 64 MiB freed
    assert _returned_mib(False) <= 8
    assert not load_config(None).learner.return_freed_memory  # off unless asked
