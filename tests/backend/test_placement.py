"""GPU placement on the local backend (issue 40): learner ranks take the first GPUs, workers the
next, fractions share one, each process started with its own CUDA_VISIBLE_DEVICES; more than the
machine shows is refused naming the keys. Decided on CPU: the environment each process starts
with, the device in each spec, the refusals."""

import pytest

from cadence.backend import PlacementError, place, visible_gpus
from cadence.backend.ranks import LocalRanks
from cadence.builder import sampling_params, worker_spec
from cadence.builder.params import gpu_placement
from cadence.config import ConfigError, load_config
from fixtures_ranks import EchoRank

EIGHT = [str(i) for i in range(8)]


def test_ranks_take_the_first_gpus_and_workers_the_next():
    got = place(4, 1.0, 4, 1.0, EIGHT)
    assert got.ranks == (("0",), ("1",), ("2",), ("3",))
    assert got.workers == (("4",), ("5",), ("6",), ("7",))
    assert got.rank_env(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert got.worker_env(3) == {"CUDA_VISIBLE_DEVICES": "7"}
    # a worker of tensor parallel 2 takes two whole GPUs
    assert place(2, 1.0, 3, 2.0, EIGHT).workers == (("2", "3"), ("4", "5"), ("6", "7"))


def test_the_parents_visible_devices_are_what_is_handed_out():
    visible = visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5,6,7"})
    assert visible == ["4", "5", "6", "7"]
    got = place(1, 1.0, 3, 1.0, visible)
    assert got.ranks == (("4",),) and got.workers == (("5",), ("6",), ("7",))
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({}, count=2) == ["0", "1"]


def test_fractions_share_a_gpu_and_a_whole_one_is_never_shared():
    one = place(1, 0.5, 1, 0.5, ["0"])  # the learner and one worker on one GPU
    assert one.ranks == (("0",),) and one.workers == (("0",),)
    assert place(1, 0.5, 3, 0.5, ["0", "1"]).workers == (("0",), ("1",), ("1",))
    mixed = place(1, 0.5, 2, 1.0, ["0", "1", "2"])
    assert mixed.ranks == (("0",),) and mixed.workers == (("1",), ("2",))
    assert place(1, 1.0, 2, 0.0, ["0"]).workers == ((), ())  # no share: no GPU


@pytest.mark.parametrize(
    ("args", "visible", "need"),
    [
        ((4, 1.0, 4, 1.0), EIGHT[:4], "need 8 GPU(s); this machine shows 4"),
        ((1, 1.0, 2, 2.0), EIGHT[:4], "need 5 GPU(s); this machine shows 4"),
        ((1, 0.5, 2, 0.5), ["0"], "need 2 GPU(s); this machine shows 1"),
        ((1, 1.0, 1, 1.0), [], "need 2 GPU(s); this machine shows 0 (none)"),
    ],
)
def test_more_gpus_than_visible_are_refused_naming_the_keys(args, visible, need):
    with pytest.raises(PlacementError, match=r"lower the counts") as info:
        place(*args, visible)
    message = str(info.value)
    assert need in message
    assert "learner.num_gpus_per_rank" in message and "pipeline.num_gpus_per_worker" in message


def test_each_rank_process_starts_seeing_only_its_own_gpus():
    placement = place(2, 1.0, 0, 0.0, ["6", "7"])
    ranks = LocalRanks(
        EchoRank, 2, spawn_args=lambda r: (f"r{r}",), timeout_s=120, env=placement.rank_env
    )
    try:
        for r in range(2):
            ranks.call(r, "build")
        ranks.wait()
        for r in range(2):
            ranks.call(r, "environ", "CUDA_VISIBLE_DEVICES")
        assert [reply for (reply,) in ranks.wait()] == ["6", "7"]
    finally:
        ranks.close()


def _cuda(*overrides):
    sets = ["model.device='cuda'", "pipeline.placement='separate'", *overrides]
    return load_config(None, sets)


def test_a_cuda_run_places_its_ranks_and_workers_and_the_workers_models_on_their_gpu(tokenizer):
    cfg = _cuda("learner.ranks=2", "pipeline.num_workers=2", "pipeline.num_gpus_per_worker=1")
    got = gpu_placement(cfg, visible=EIGHT[:4])
    assert got.ranks == (("0",), ("1",)) and got.workers == (("2",), ("3",))
    spec = worker_spec(cfg, sampling_params(cfg, tokenizer))
    assert spec.device == "cuda"  # the first GPU its process sees: its own
    assert worker_spec(load_config(None), sampling_params(cfg, tokenizer)).device == "cpu"
    shared = _cuda("learner.num_gpus_per_rank=0.5", "pipeline.num_gpus_per_worker=0.5")
    assert gpu_placement(shared, visible=["0"]).workers == (("0",),)
    assert gpu_placement(load_config(None), visible=[]) is None  # a CPU run places nothing
    with pytest.raises(ConfigError, match=r"need 4 GPU\(s\); this machine shows 3"):
        gpu_placement(cfg, visible=EIGHT[:3])


def test_cadence_train_asking_for_gpus_this_machine_lacks_exits_2_before_loading(
    model_dir, tmp_path, capsys, monkeypatch
):
    from cadence.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU shown (none is touched)
    sets = [
        f"model.path='{model_dir}'",
        "model.device='cuda'",
        "pipeline.placement='separate'",
        "pipeline.num_workers=2",
        "pipeline.num_gpus_per_worker=1",
    ]
    argv = ["train", "configs/default.toml", "--out", str(tmp_path / "run")]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "need 3 GPU(s); this machine shows 1 (CUDA_VISIBLE_DEVICES=0)" in err
    assert "pipeline.num_gpus_per_worker = 1" in err


def test_the_shipped_8_gpu_config_puts_ranks_on_0_to_3_and_workers_on_4_to_7():
    cfg = load_config("configs/qwen7b-8gpu.toml")
    got = gpu_placement(cfg, visible=EIGHT)
    assert got.ranks == tuple((str(i),) for i in range(4))
    assert got.workers == tuple((str(i),) for i in range(4, 8))
    with pytest.raises(ConfigError, match=r"need 8 GPU\(s\); this machine shows 4"):
        gpu_placement(cfg, visible=EIGHT[:4])
