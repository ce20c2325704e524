"""The Ray backend: the unchanged pipeline on Ray actors, equal to the local backend, and clean
exits. One local Ray (2 CPUs) serves the module; the CLI tests start their own in a subprocess.
Runs are two iterations: the second generates with the weights the first trained, which is what
an equality of updates needs; each run a test only reads is made once for the module."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from cadence.backend import WorkerDied
from cadence.builder import build_run, train
from cadence.metrics import MemorySink
from cadence.models import load_model
from partial_runs import publish_when_idle
from runs import (
    TWO_WORKERS,
    UNFILTERED,
    KillOnFirstGroups,
    processes,
    run_config,
    session_alive,
    train_run,
)
from updates import assert_same_update, capture_grads, max_relative_diff


def test_a_ray_imported_before_the_run_starts_one_it_can_join():
    # vLLM imports Ray: Ray then read its authentication mode before the run chose token
    # authentication for the Ray it starts, and the run could not join its own Ray
    # ("InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'")
    code = (
        "import ray; from cadence.backend.ray.pool import shutdown_ray, start_ray; "
        "start_ray(None, num_cpus=1); assert ray.get(ray.put(7)) == 7; shutdown_ray()"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def ray_cluster():
    from cadence.backend.ray.pool import shutdown_ray, start_ray

    started = start_ray(None, num_cpus=2)
    import ray

    yield ray
    if started:
        shutdown_ray()


def _cfg(model_dir, mode, *extra, backend="ray"):
    where = ("pipeline.placement='separate'", f"pipeline.backend='{backend}'")
    return run_config(model_dir, f"pipeline.mode='{mode}'", "train.iterations=2", *where, *extra)


@pytest.fixture(scope="module")
def ray_sync_run(ray_cluster, model_dir, tmp_path_factory):
    """One sync run on Ray, the reference for the periodic runs below."""
    grads: list = []
    cfg = _cfg(model_dir, "sync", *TWO_WORKERS)
    run, records, _ = train_run(cfg, tmp_path_factory.mktemp("s"), grads, evaluate=False)
    return run.trainer.model, records, grads


def _assert_same_update_as_sync(ray_sync_run, run, records, grads):
    """The claim and tolerances of the local backend's test (tests/pipeline/test_periodic.py)."""
    sync_model, sync_records, sync_grads = ray_sync_run
    assert len(grads) == 2
    assert max_relative_diff(grads[0], sync_grads[0]) <= 1e-5
    assert_same_update(run.trainer.model, sync_model, grads, sync_grads, grad_rtol=5e-5)
    assert [r["reward_mean"] for r in sync_records] == [r["reward_mean"] for r in records]
    assert all(r["staleness_max"] == 0 and r["optimizer_steps"] == 1 for r in records)


def _kill_first_actor(ray):
    """`KillOnFirstGroups`'s kill: worker 0's Ray actor, as an out-of-memory kill would."""
    return lambda pool: ray.kill(pool._actors[0])


@pytest.fixture(scope="module")
def ray_periodic_run(ray_cluster, model_dir, tmp_path_factory):
    """One periodic run on Ray, two workers, worker 0's actor killed when iteration 1's first
    groups arrive (`KillOnFirstGroups`): its update, its sample store (in an actor) and when
    the kill came. One run for both claims: a Ray run (actors importing torch and transformers)
    is most of this module's time."""
    run = build_run(_cfg(model_dir, "periodic", *TWO_WORKERS))
    grads = capture_grads(run.trainer)
    killer = KillOnFirstGroups(run.source.pool, _kill_first_actor(ray_cluster))
    sink = MemorySink()
    train(run, tmp_path_factory.mktemp("p"), extra_sinks=[sink], evaluate=False)
    return run, sink.records, grads, killer.killed_at


@pytest.mark.slow
def test_periodic_update_equals_sync_update_on_ray(ray_sync_run, ray_periodic_run, model_dir):
    run, records, grads, _ = ray_periodic_run
    _assert_same_update_as_sync(ray_sync_run, run, records, grads)
    assert all(r["policy_version"] == r["iteration"] for r in records)
    assert _max_diff(load_model(model_dir), run.trainer.model) > 1e-4  # it really trained
    assert _no_worker_actor_left()


def _max_diff(model_a, model_b) -> float:
    pairs = zip(model_a.parameters(), model_b.parameters(), strict=True)
    return max((a - b).abs().max().item() for a, b in pairs)


def _no_worker_actor_left(wait_s: float = 10.0) -> bool:
    """No process of a worker actor ('ray::RayWorker...') is alive, within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not [c for c in _processes() if c.startswith("ray::RayWorker")]:
            return True
        time.sleep(0.2)
    return False


# One worker and one task per iteration: the engine gets each iteration's prompts at once, so
# groups finish, and reach the learner, in the same order on both backends.
_DETERMINISTIC = (
    "pipeline.num_workers=1",
    "pipeline.prompts_per_task=6",
    "pipeline.tasks_in_flight=1",
    "pipeline.max_staleness=1",
)


@pytest.fixture(scope="module")
def local_offpolicy_run(model_dir, tmp_path_factory):
    cfg = _cfg(model_dir, "offpolicy", *_DETERMINISTIC, backend="local")
    run, records, _ = train_run(cfg, tmp_path_factory.mktemp("local"))
    return run.trainer.model, records


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["object_store", "broadcast"])
def test_ray_run_ends_with_the_local_run_parameters(
    ray_cluster, local_offpolicy_run, model_dir, tmp_path, weight_sync
):
    local_model, local_records = local_offpolicy_run
    cfg = _cfg(model_dir, "offpolicy", *_DETERMINISTIC, f"pipeline.weight_sync='{weight_sync}'")
    run, records, _ = train_run(cfg, tmp_path)
    assert [r["staleness_hist"] for r in records] == [[6, 0], [0, 6]]
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in local_records]
    assert _max_diff(run.trainer.model, local_model) <= 1e-6
    assert _max_diff(load_model(model_dir), local_model) > 1e-4  # both really trained


@pytest.mark.slow
def test_a_partial_rollout_run_on_ray_equals_the_local_offpolicy_run(
    ray_cluster, local_offpolicy_run, model_dir, tmp_path
):
    # the workers take new weights mid-sequence on Ray as locally (the same worker loop); with
    # no update arriving mid-sequence the run is the local offpolicy run
    local_model, local_records = local_offpolicy_run
    partial = ("pipeline.partial_rollout=true", "pipeline.partial_rollout_kv='recompute'")
    run = build_run(_cfg(model_dir, "offpolicy", *_DETERMINISTIC, *partial))
    publish_when_idle(run.source, 6)
    sink = MemorySink()
    train(run, tmp_path, extra_sinks=[sink], evaluate=False)
    records = sink.records
    assert [r["staleness_hist"] for r in records] == [[6, 0], [0, 6]]
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in local_records]
    assert all(r["trajectory_spans"] == 1.0 for r in records)
    assert _max_diff(run.trainer.model, local_model) <= 1e-6


@pytest.mark.slow
def test_killed_actor_is_reported_with_its_prompts_and_nothing_hangs(
    ray_cluster, model_dir, tmp_path
):
    # two prompts at a time (the default would send the iteration's four at once): the actor
    # killed at the first groups holds prompts in flight
    one = ("pipeline.num_workers=1", "pipeline.prompts_per_task=1", "pipeline.tasks_in_flight=2")
    run = build_run(_cfg(model_dir, "periodic", *one, "pipeline.max_worker_restarts=0"))
    killer = KillOnFirstGroups(run.source.pool, _kill_first_actor(ray_cluster))
    errors: list[BaseException] = []

    def target():
        try:
            train(run, tmp_path)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the run hung after its worker was killed"
    assert killer.killed_at is not None
    (error,) = errors
    assert isinstance(error, WorkerDied) and error.wid == 0
    assert "worker 0 (Ray actor, pid" in str(error)
    assert "killed by `ray.kill`" in str(error)
    assert re.search(r"prompts in flight: arithmetic:\d+", str(error)), str(error)
    assert "pipeline.max_worker_restarts = 0" in str(error)
    assert _no_worker_actor_left()


@pytest.mark.slow
def test_killed_actor_is_replaced_and_the_update_equals_sync(ray_sync_run, ray_periodic_run):
    # killed mid-iteration: the replacement loads the current version and regenerates the
    # prompts the dead actor had not returned, with the same seeds: the very update of sync
    run, records, grads, killed_at = ray_periodic_run
    assert killed_at is not None
    assert [r["worker_restarts"] for r in records] == [0, 1]
    _assert_same_update_as_sync(ray_sync_run, run, records, grads)


@pytest.mark.slow
def test_worker_exception_reaches_the_driver_with_its_traceback(ray_cluster, model_dir, tmp_path):
    from cadence.backend import WorkerError, WorkerSpec
    from cadence.backend.ray.pool import RayPool
    from cadence.engine import SamplingParams

    spec = WorkerSpec(
        model_path=str(tmp_path / "no-model"),
        dtype="float32",
        reward="math",
        sampling=SamplingParams(max_new_tokens=4),
        group_size=2,
        run_seed=0,
        threads=1,
        max_num_seqs=4,
    )
    with pytest.raises(WorkerError, match=r"(?s)worker 0 failed:.*Traceback.*no-model"):
        RayPool(spec, load_model(model_dir), 1, timeout_s=60)
    assert _no_worker_actor_left()


def _processes(sid: int | None = None) -> list[str]:
    """Command lines of live processes, of session `sid` if given."""
    return [p.cmdline for p in processes() if p.state != "Z" and sid in (None, p.sid)]


def _cli_run_on_ray(model_dir, out, iterations: int) -> subprocess.Popen:
    """`cadence train` on a Ray it starts itself, in a session of its own."""
    overrides = [
        f"model.path='{model_dir}'",
        "pipeline.placement='separate'",
        "pipeline.backend='ray'",
        "pipeline.mode='periodic'",
        "pipeline.ray_num_cpus=2",
        f"train.iterations={iterations}",
        "train.prompts_per_iteration=4",
        "rollout.max_new_tokens=8",
        "data.num_heldout=2",
        "metrics.progress=false",
        UNFILTERED,  # an iteration of 4 prompts, not up to 132
    ]
    args = [sys.executable, "-m", "cadence.cli", "train", "configs/default.toml"]
    args += ["--out", str(out)] + [a for o in overrides for a in ("--set", o)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


@pytest.mark.slow
def test_a_cli_run_on_ray_leaves_no_ray_process_whether_it_ends_or_its_learner_is_sigkilled(
    model_dir, tmp_path
):
    # Two `cadence train` at once, each on the Ray it starts (a local Ray takes free ports): one
    # ends after an iteration, the other's learner is SIGKILLed once it has trained one. Before
    # the reaper, Ray's dashboard and runtime-env agents outlived a SIGKILLed learner by 60-95 s,
    # waiting on a timeout of Ray's to report the raylet's death to a GCS that had died with it.
    ends = _cli_run_on_ray(model_dir, tmp_path / "ends", iterations=1)
    killed = _cli_run_on_ray(model_dir, tmp_path / "killed", iterations=1000)
    try:
        _end_one_kill_the_other(ends, killed, tmp_path)
    finally:  # a failed assertion leaves neither run nor its Ray behind
        for run in (ends, killed):
            for p in session_alive(run.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            run.wait()


def _end_one_kill_the_other(ends, killed, tmp_path) -> None:
    seen: list[str] = []  # the Ray processes the ending run starts, to check them after

    def note() -> None:
        seen.extend(c for c in _processes(ends.pid) if c not in seen)

    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not metrics.exists() or not metrics.stat().st_size:
        assert killed.poll() is None, killed.stderr.read().decode()
        assert time.monotonic() < deadline, "training did not start"
        note()
        time.sleep(0.2)
    ray_processes = [c for c in _processes(killed.pid) if "ray::" in c or "raylet" in c]
    assert any("DashboardAgent" in c for c in ray_processes), ray_processes
    killed.kill()
    killed.wait()
    while ends.poll() is None:
        note()
        time.sleep(0.5)
    assert ends.returncode == 0, ends.stderr.read().decode()
    assert any("raylet" in c for c in seen) and any("gcs_server" in c for c in seen)
    assert (tmp_path / "ends" / "metrics.jsonl").read_text().strip()
    deadline = time.monotonic() + 15  # the reaper's grace is 3 s; Ray's own timeout 60 s
    while (_processes(ends.pid) or _processes(killed.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes(ends.pid) == [] and _processes(killed.pid) == []


def test_the_reaper_stops_the_processes_of_its_ray_session_and_no_other(tmp_path):
    from cadence.backend.ray import reaper as ray_reaper

    session = tmp_path / "session_1"
    (session / "logs").mkdir(parents=True)
    holds_a_log = "import sys, time; f = open(sys.argv[1], 'a'); print(flush=True); time.sleep(60)"
    python = subprocess.Popen(  # like a Ray agent: the interpreter, a log of the session open
        [sys.executable, "-c", holds_a_log, str(session / "logs" / "agent.log")],
        stdout=subprocess.PIPE,
    )
    other = subprocess.Popen(  # like `tail -f` of a log: another program, left alone
        ["sh", "-c", f"exec 3>>{session}/logs/tail.log; exec sleep 60"]
    )
    elsewhere = subprocess.Popen(  # the interpreter, but no file of the session open
        [sys.executable, "-c", holds_a_log, str(tmp_path / "other.log")], stdout=subprocess.PIPE
    )
    try:
        python.stdout.readline()
        elsewhere.stdout.readline()
        time.sleep(0.2)  # sh has exec'd sleep with the log open
        ray_dir = str(tmp_path / "no-ray-here")
        assert ray_reaper.ray_processes(str(session), ray_dir) == [python.pid]
        assert ray_reaper.ray_processes(str(session), ray_dir, spare=(python.pid,)) == []
        assert ray_reaper.reap(str(session), ray_dir, grace_s=3.0) == 1
        assert python.wait(timeout=5) == -15  # SIGTERM
        assert other.poll() is None and elsewhere.poll() is None
    finally:
        for p in (python, other, elsewhere):
            p.kill()
            p.wait()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_broadcast_run_between_gpus(ray_cluster, model_dir, tmp_path):
    cfg = _cfg(
        model_dir,
        "periodic",
        "model.device='cuda:1'",  # Ray gives the worker the first free GPU, cuda:0
        "pipeline.num_gpus_per_worker=1",
        "pipeline.weight_sync='broadcast'",
    )
    _, records, _ = train_run(cfg, tmp_path)
    assert [r["policy_version"] for r in records] == [0, 1, 2]


def test_rank_actors_wait_on_silence_not_on_the_work_queued(ray_cluster):
    # Before: RayRanks.wait gave every reply of a wait one deadline: four queued 1-s calls
    # under a 2.5-s limit timed out though nothing hung. A hung rank is still named.
    import fixtures_ranks
    from cadence.backend.ray.ranks import RayRanks

    # the actors unpickle the factory before they can see the tests' folder: ship it by value
    ray_cluster.cloudpickle.register_pickle_by_value(fixtures_ranks)
    ranks = RayRanks(fixtures_ranks.EchoRank, 2, ("hello",), timeout_s=60)
    try:
        for r in range(2):
            ranks.call(r, "build")
        ranks.wait()
        for _ in range(4):
            ranks.call(0, "sleep", 1.0)
        assert ranks.wait(timeout_s=2.5) == [[None] * 4, []]
        ranks.call(0, "sleep", 1.0)
        ranks.call(1, "sleep", 30.0)
        with pytest.raises(TimeoutError, match=r"within 2.5s: \{1: \['sleep'\]\}$"):
            ranks.wait(timeout_s=2.5)
    finally:
        ranks.close()


def test_the_store_lives_in_an_actor_with_the_same_behaviour(ray_cluster):
    from cadence.backend.ray.store import ActorStore
    from cadence.dataplane import StaleRowError, StoreClosed
    from cadence.types import SampleRow

    store = ActorStore()
    rows = [SampleRow(i, 0, i, 2, 0, 3) for i in range(2)]
    store.put(rows[:1], {"x": ["a"]})
    assert store.depth(["x"], "t", groups=True) == 0  # the group is not complete yet
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.get(["x"], 1, "t", timeout=30)))
    reader.start()  # waits in the actor while the put below goes through
    store.put(rows[1:], {"x": ["b"]})
    reader.join(10)
    assert not reader.is_alive() and [r.index for r in got[0].rows] == [0, 1]
    store.put([SampleRow(2, 1, 0, 1, 0, 3)], {"x": ["c"]})
    with pytest.raises(StaleRowError, match="policy_version 3"):  # the store's own exception
        store.get(["x"], 1, "u", timeout=0, version=4)
    store.close()
    with pytest.raises(StoreClosed):
        store.put([SampleRow(3, 2, 0, 1, 0, 3)], {"x": ["d"]})


@pytest.mark.slow
def test_a_ray_run_keeps_its_sample_store_in_an_actor(ray_periodic_run):
    from cadence.backend.ray.store import ActorStore

    run, records, _, _ = ray_periodic_run
    assert isinstance(run.source.store, ActorStore)
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(r["staleness_max"] == 0 and r["stage_gen_rows_per_s"] > 0 for r in records)
