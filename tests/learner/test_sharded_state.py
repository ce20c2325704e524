"""Sharded learner state (DCP, safetensors): written by N ranks, read back by M."""

import pytest
import torch
import torch.multiprocessing as mp

from cadence.backend.procs import fork_server
from fixtures_ranks import sharded_state_rank

pytestmark = pytest.mark.slow  # five rank processes


def _ranks(world, mode, tmp_path, model_dir, out):
    store = f"file://{tmp_path / f'store-{mode}-{world}'}"
    args = (world, mode, store, model_dir, tmp_path / "ckpt", tmp_path / out)
    # forked from the fork server the learner's own rank processes come from (torch,
    # transformers and cadence imported once), not each a fresh interpreter (~5 s of CPU)
    fork_server()  # its preload, then the processes
    mp.start_processes(sharded_state_rank, args=args, nprocs=world, start_method="forkserver")
    return torch.load(tmp_path / out)


def test_state_written_by_two_ranks_loads_into_three_exactly(model_dir, tmp_path):
    saved = _ranks(2, "save", tmp_path, model_dir, "saved.pt")
    loaded = _ranks(3, "load", tmp_path, model_dir, "loaded.pt")
    assert saved.keys() == loaded.keys()
    assert (
        any(k.endswith(".exp_avg_sq") for k in saved) and "optim.lm_head.weight.step" not in saved
    )
    assert saved["optim.model.norm.weight.step"].item() == 1.0  # one step taken, and restored
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert all(f.endswith(".safetensors") for f in files) and len(files) == 2  # one per rank
