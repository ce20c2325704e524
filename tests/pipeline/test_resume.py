"""Exact resume: a run killed with SIGKILL mid-iteration, then resumed, ends where an
uninterrupted run with the same seed ends, and writes each iteration's metrics once."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from cadence.cli import main
from cadence.models import load_model
from cadence.pipeline.checkpoint_files import list_checkpoints
from runs import UNFILTERED, Cadence, in_process, session_alive

pytestmark = pytest.mark.slow

MODES = {
    # mode: (overrides, the reward call that lands in iteration 3: 16 samples an iteration)
    "sync": (["pipeline.mode='sync'", "train.threads=1"], 4 + 3 * 16 + 8),  # + 4 held-out
    "periodic": (
        [
            "pipeline.mode='periodic'",
            "pipeline.placement='separate'",
            "pipeline.num_workers=1",
            "pipeline.learner_threads=1",
            "pipeline.prompts_per_task=4",  # one task: groups arrive in the same order each run
        ],
        3 * 16 + 8,
    ),
    # two learner ranks (FSDP2): the ranks' shards are checkpointed with DCP and read back
    "periodic-2-ranks": (
        [
            "pipeline.mode='periodic'",
            "pipeline.placement='separate'",
            "pipeline.num_workers=1",
            "pipeline.learner_threads=2",
            "pipeline.prompts_per_task=4",
            "learner.ranks=2",
        ],
        3 * 16 + 8,
    ),
}


def _sets(model_dir, mode):
    common = [
        f"model.path='{model_dir}'",
        "train.iterations=5",
        "train.prompts_per_iteration=4",
        "train.micro_batch_groups=2",
        "train.lr=1e-3",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=1",
        "rollout.group_size=4",
        "rollout.max_new_tokens=10",
        "data.num_heldout=4",
        "algo.kl_coef=0.05",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:kill_learner_once'",
        UNFILTERED,  # 16 reward calls an iteration: the kill's count holds
    ]
    return [a for s in common + MODES[mode][0] for a in ("--set", s)]


def _iterations(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["iteration"] for line in lines]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_killed_mid_iteration_resumes_to_the_same_parameters(
    model_dir, tmp_path, monkeypatch, mode
):
    marker, never = tmp_path / "killed", tmp_path / "never-killed"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(sys.path),
        "CADENCE_TEST_KILL_AT": str(MODES[mode][1]),
    }
    sets = ["train", "configs/default.toml", *_sets(model_dir, mode)]
    full, killed = tmp_path / "full", tmp_path / "killed-run"

    # The run killed mid-iteration is a `cadence` process of its own: SIGKILL ends it as a crash
    # would. The uninterrupted run and the resumed one need no process of their own: they run
    # here (as `cadence`, through its `main`), their workers forked from this process's fork
    # server, and find their marker taken, so they kill nothing. The uninterrupted run trains
    # while the killed one does.
    never.touch()
    monkeypatch.setenv("CADENCE_TEST_KILL_AT", str(MODES[mode][1]))
    monkeypatch.setenv("CADENCE_TEST_KILL_MARKER", str(never))
    proc = Cadence([*sets, "--out", str(killed)], env, marker, tmp_path / "killed.err")
    try:
        assert in_process([*sets, "--out", str(full)]) == 0
        assert proc.wait(timeout=300) == -9, proc.stderr()  # SIGKILL, mid-iteration 3
    except BaseException:  # only then: the check below wants the workers to exit on their own
        proc.stop()
        raise
    assert marker.exists()
    deadline = time.monotonic() + 10  # its workers notice the learner is gone and exit
    while session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_alive(proc.pid), session_alive(proc.pid)
    assert _iterations(killed) == [0, 1, 2]  # iteration 2 ran past the checkpoint taken after 1
    assert [p.name for p in list_checkpoints(killed)] == ["iter-000002"]
    assert not (killed / "final").exists()

    assert in_process(["train", "--resume", str(killed)]) == 0
    assert _iterations(killed) == [0, 1, 2, 3, 4]  # each exactly once
    assert [p.name for p in list_checkpoints(killed)] == ["iter-000005"]  # the newest kept
    assert not list((killed / "checkpoints").glob(".*"))  # no temporary directory left

    a, b = load_model(full / "final"), load_model(killed / "final")
    fresh = load_model(model_dir)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=0, atol=1e-6), name
    pairs = zip(a.parameters(), fresh.parameters(), strict=True)
    moved = max((pa - p0).abs().max().item() for pa, p0 in pairs)
    assert moved > 1e-4  # five real updates, not two untrained models


def test_resume_errors_name_the_problem(model_dir, tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "no checkpoint in it" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "needs a CONFIG file" in capsys.readouterr().err
    (tmp_path / "unfinished" / "checkpoints" / "iter-000002").mkdir(parents=True)
    args = ["train", "configs/default.toml", "--out", str(tmp_path / "unfinished")]
    assert main([*args, "--set", f"model.path='{model_dir}'"]) == 2
    assert "did not finish: continue it with `cadence train --resume" in capsys.readouterr().err


class Interrupted(Exception):
    """Raised from inside an iteration: the run stops mid-iteration, as a crash would."""


def _offpolicy_cfg(model_dir):
    from cadence.config import load_config

    return load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "pipeline.mode='offpolicy'",
            "pipeline.max_staleness=1",
            "pipeline.filter_groups='zero_variance'",
            "pipeline.placement='separate'",
            "pipeline.num_workers=1",
            "pipeline.learner_threads=1",
            "pipeline.prompts_per_task=4",
            "pipeline.tasks_in_flight=1",  # one task at a time: groups arrive in one order
            "train.iterations=6",
            "train.prompts_per_iteration=4",
            "train.micro_batch_groups=2",
            "train.lr=1e-3",
            "train.checkpoint_every=3",
            "train.keep_checkpoints=1",
            "rollout.group_size=2",  # half the groups constant: extra prompts every iteration
            "rollout.max_new_tokens=10",
            "data.num_heldout=4",
            "algo.kl_coef=0.05",
            "metrics.progress=false",
            "reward.function='fixtures_rewards:even_length'",
        ],
    )


def _recorded_train(cfg, out, trained, resume=None, stop_in=None):
    """Train (from `resume`), recording each trained group's (policy_version, prompt uid) by
    iteration in `trained`; raise `Interrupted` after the second group of iteration `stop_in`."""
    from cadence.builder import build_run, train

    run = build_run(cfg, resume=resume)
    groups = run.source.groups

    def recording():
        for g in groups():
            trained.setdefault(g.iteration, []).append((g.policy_version, g.prompt.uid))
            if g.iteration == stop_in and len(trained[g.iteration]) == 2:
                raise Interrupted(f"stopped in iteration {stop_in}")
            yield g

    run.source.groups = recording
    train(run, out)
    return run


def test_an_offpolicy_run_with_dynamic_sampling_resumes_to_the_same_prompts_and_parameters(
    model_dir, tmp_path
):
    from cadence.pipeline.checkpoint import find_checkpoint

    cfg = _offpolicy_cfg(model_dir)
    full: dict[int, list] = {}
    _recorded_train(cfg, tmp_path / "full", full)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    assert sum(r["oversampled_prompts"] for r in records) > 0  # extra prompts were drawn
    assert max(r["staleness_max"] for r in records) == 1  # generation really ran ahead

    killed = tmp_path / "killed"
    resumed: dict[int, list] = {}
    with pytest.raises(Interrupted):
        _recorded_train(cfg, killed, resumed, stop_in=4)  # one past the checkpoint after 3
    assert [p.name for p in list_checkpoints(killed)] == ["iter-000003"]
    for k in (3, 4):
        resumed.pop(k, None)  # the iterations the resumed run does again
    _recorded_train(cfg, killed, resumed, resume=find_checkpoint(killed))
    assert _iterations(killed) == list(range(6))

    assert resumed == full  # the same prompts, by the same versions, in the same order
    uids = [uid for groups in full.values() for _, uid in groups]
    assert len(set(uids)) == len(uids)  # none trained twice
    a, b = load_model(tmp_path / "full" / "final"), load_model(killed / "final")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=0, atol=1e-6), name
