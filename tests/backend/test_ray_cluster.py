"""The cluster recipe of docs/ray.md on one machine: a head node, where the learner runs (the Ray
driver, joining with `pipeline.ray_address = "auto"`), and worker nodes that offer custom
resources, as `ray start --address=HEAD --resources=...` would start them. Rollout workers and
learner ranks go to the nodes whose resources they ask for; a periodic run there makes the sync
update; a worker node whose raylet is killed mid-run is survived as a killed worker process is
(the worker is replaced on another node that offers its resources), and with no such node left
the run stops at once naming the resource.

The nodes are `ray.cluster_utils.Cluster`'s: real raylets, each its own processes, on loopback.
They use token authentication with a token of the module's own, in the environment, as the run
that joins them does (docs/ray.md): the cluster and the run must share `RAY_AUTH_*`. GCS checks
every node's health each half second here (Ray's default: every 3 s, 5 misses) so that a lost
node is declared dead within seconds.
"""

from __future__ import annotations

import re
import secrets
import shutil
import sys
import tempfile
import time

import pytest

from cadence.backend import WorkerDied, WorkerError
from cadence.builder import build_run, train
from cadence.config import load_config
from cadence.metrics import MemorySink
from cadence.models import load_model
from runs import KillOnFirstGroups
from updates import assert_same_params, capture_grads

pytestmark = pytest.mark.slow

_FAST_HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
    # on a busy 2-core machine a node's agents can take longer than Ray's 30 s to start
    "agent_register_timeout_ms": 120_000,
}


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (nothing but the driver and what it pins there), a 'trainer' node
    for two learner ranks and two 'rollout' nodes of one worker each."""
    env = pytest.MonkeyPatch()
    temp = tempfile.mkdtemp(prefix="cadence-rc-")  # short: Ray's socket paths live under it
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.delenv(key, raising=False)
    env.setenv("RAY_TMPDIR", temp)  # the session files, and the address "auto" finds
    env.setenv("RAY_AUTH_MODE", "token")
    env.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    env.setenv("RAY_USAGE_STATS_ENABLED", "0")
    env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1
    _ray_reads_the_environment(env)
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "include_dashboard": False, "_system_config": _FAST_HEALTH}
    nodes = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes.add_node(num_cpus=2, resources={"trainer": 2})
        for _ in range(2):
            nodes.add_node(num_cpus=1, resources={"rollout": 1})
        yield nodes
    finally:
        import ray

        ray.shutdown()
        nodes.shutdown()
        env.undo()
        _ray_reads_the_environment(None)
        shutil.rmtree(temp, ignore_errors=True)


def _ray_reads_the_environment(env: pytest.MonkeyPatch | None) -> None:
    """An imported Ray (an earlier test's) read its settings at import: read them again."""
    if "ray" not in sys.modules:
        return
    from ray._private import ray_constants

    from cadence.backend.ray.cluster import reload_ray_auth

    reload_ray_auth()
    if env is not None:
        env.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)


def _cfg(model_dir, mode, *extra):
    return load_config(
        None,
        [
            f"model.path='{model_dir}'",
            f"pipeline.mode='{mode}'",
            "pipeline.placement='separate'",
            "pipeline.backend='ray'",
            "pipeline.ray_address='auto'",
            "pipeline.ray_worker_resources={ rollout = 1 }",
            "pipeline.prompts_per_task=1",
            # two of an iteration's four prompts at a time (the default would send all four at
            # once): the node killed at the first groups has prompts in flight to re-run
            "pipeline.tasks_in_flight=2",
            "pipeline.learner_threads=1",
            "train.iterations=2",  # the second generates with the weights the first trained
            "train.prompts_per_iteration=4",
            "train.micro_batch_groups=1",
            "train.lr=1e-3",
            "train.checkpoint_every=0",
            "rollout.group_size=4",
            "rollout.max_new_tokens=8",
            "algo.kl_coef=0.05",
            "metrics.progress=false",
            "reward.function='fixtures_rewards:even_length'",
            *extra,
        ],
    )


def _node_of(actor) -> str:
    import ray

    return ray.get(actor.where.remote())[0]


def _nodes_with(nodes, resource: str) -> set[str]:
    """The live nodes that offer `resource` (asked of the GCS: no driver needed)."""
    table = nodes.global_state.node_table()
    return {n["NodeID"] for n in table if n["Alive"] and resource in n["Resources"]}


def _kill_node_of(actor, cluster) -> str:
    """SIGKILLs the raylet of the node `actor` runs on; returns the node's id."""
    killed = _node_of(actor)
    (node,) = [n for n in cluster.worker_nodes if n.node_id == killed]
    node.kill_raylet()
    return killed


class _Placement(MemorySink):
    """Records, with each iteration's metrics, the nodes of the driver, of worker 0 and of the
    learner ranks (if any), while the run holds them."""

    def __init__(self, run) -> None:
        super().__init__()
        self.run, self.nodes = run, []

    def write(self, record) -> None:
        import ray

        super().write(record)
        ranks = getattr(self.run.trainer, "ranks", None)
        self.nodes.append(
            {
                "driver": ray.get_runtime_context().get_node_id(),
                "worker": _node_of(self.run.source.pool._actors[0]),
                "ranks": [w[0] for w in ranks.transport.where] if ranks else [],
            }
        )


def test_a_run_on_the_cluster_places_by_resources_survives_a_lost_node_and_makes_the_sync_update(
    cluster, model_dir, tmp_path
):
    head, trainer = cluster.head_node.node_id, _nodes_with(cluster, "trainer")
    rollout = _nodes_with(cluster, "rollout")
    grads: list = []
    sync = build_run(_cfg(model_dir, "sync"))  # joins the cluster: "auto" finds it
    capture_grads(sync.trainer, grads)
    want = _Placement(sync)
    train(sync, tmp_path / "sync", extra_sinks=[want], evaluate=False)
    assert all(n["driver"] == head and n["worker"] in rollout for n in want.nodes)

    run = build_run(_cfg(model_dir, "periodic", "learner.ranks=2", _RANKS_ON_TRAINER))
    killer = KillOnFirstGroups(
        run.source.pool, lambda pool: _kill_node_of(pool._actors[0], cluster)
    )
    got = _Placement(run)
    train(run, tmp_path / "periodic", extra_sinks=[got], evaluate=False)

    assert killer.killed in rollout and got.records[-1]["worker_restarts"] == 1
    assert _nodes_with(cluster, "rollout") == rollout - {killer.killed}  # the cluster goes on
    assert got.nodes[0]["worker"] == killer.killed  # placed there before the kill
    assert got.nodes[-1]["worker"] in rollout - {killer.killed}  # replaced on the other one
    assert all(n["driver"] == head and set(n["ranks"]) == trainer for n in got.nodes)
    assert [r["reward_mean"] for r in got.records] == [r["reward_mean"] for r in want.records]
    assert all(r["staleness_max"] == 0 and r["learner_ranks"] == 2 for r in got.records)
    params = {k: v.detach() for k, v in run.trainer.model.named_parameters()}
    want_params = {k: v.detach() for k, v in sync.trainer.model.named_parameters()}
    assert_same_params(params, want_params, grads)
    fresh = dict(load_model(model_dir).named_parameters())
    assert max((params[k] - p).abs().max().item() for k, p in fresh.items()) > 1e-4  # trained


_RANKS_ON_TRAINER = "learner.ray_rank_resources={ trainer = 1 }"


def test_a_worker_whose_resource_no_live_node_offers_stops_at_once_naming_it(cluster, model_dir):
    from cadence.backend.ray.pool import RayPool
    from cadence.builder import sampling_params, worker_spec
    from cadence.models import load_tokenizer

    lonely = cluster.add_node(num_cpus=1, resources={"lonely": 1})
    cfg = _cfg(model_dir, "periodic")
    spec = worker_spec(cfg, sampling_params(cfg, load_tokenizer(model_dir)))
    model = load_model(model_dir)
    pool = RayPool(spec, model, 1, timeout_s=120, address="auto", custom_resources={"lonely": 1})
    try:
        assert _node_of(pool._actors[0]) == lonely.node_id
        lonely.kill_raylet()
        with pytest.raises(WorkerDied) as died:
            while True:  # the actor's death reaches the driver once GCS declares the node dead
                pool.poll(1.0)
        assert re.search(
            r"worker 0 \(Ray actor, pid \d+ on 127.0.0.1\) died: .*node", str(died.value)
        )
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"worker 0 .* cannot be replaced: .*'lonely'"):
            pool.replace(died.value.wid)
        assert time.monotonic() - start < 10  # at once, not after pipeline.worker_timeout_s
    finally:
        pool.close()
    assert _nodes_with(cluster, "rollout")  # the pool left the cluster up
    with pytest.raises(WorkerError, match=r"cannot start: .*no live node .* resource 'lonely'"):
        RayPool(spec, model, 1, timeout_s=120, address="auto", custom_resources={"lonely": 1})
