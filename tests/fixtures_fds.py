"""Worker processes started under a low open-files limit (tests/backend/test_procs.py runs
`main` in a process of its own): each takes a list of shared tensors, one file descriptor each
while in flight."""

import resource
import sys

import torch

from cadence.backend.procs import Processes


def _target(wid, tensors, inbox, results) -> None:
    results.send(("ready", wid, len(tensors)))
    inbox.get()  # "stop"


def main(limit: int, num_tensors: int, num_workers: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    tensors = [torch.zeros(2).share_memory_() for _ in range(num_tensors)]
    procs = Processes("worker", _target, lambda wid: (tensors,), timeout_s=60)
    procs.start(num_workers)
    procs.close()
    print("started", num_workers)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
