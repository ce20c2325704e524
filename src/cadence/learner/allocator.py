"""Freed host memory back to the OS at once (`learner.return_freed_memory`).

glibc serves an allocation above its mmap threshold with a mapping of its own, returned to the
OS when freed, and below it from the C heap, where freed blocks stay and fragment. The threshold
starts at 128 KiB and rises to the size of every large block freed (up to 32 MiB), so a learner's
activations (tens of MiB each, freed every micro-batch) soon live on the heap, and the process's
peak grows with the response length far past what is alive at any moment. A fixed threshold
stops the rise. Host memory only: GPU memory has its own allocator. docs/learner.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD_BYTES = 1 << 20


def return_freed_memory(threshold: int = THRESHOLD_BYTES) -> bool:
    """Serve every block of `threshold` bytes or more with a mapping of its own, from now on in
    this process; False where the C library is not glibc (nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
