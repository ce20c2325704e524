"""The Ray a run uses: one it starts on this machine, or a cluster it joins, and where actors
may run on it.

Read on: docs/ray.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
from typing import Any, cast

import cadence.backend.ray.reaper as ray_reaper

_reaper: subprocess.Popen | None = None  # of the Ray this process started (ray/reaper.py)


def local_ray_env() -> None:
    """Settings a Ray started for the run must see (an imported Ray is made to read them again)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's single-machine mode: its node address, and so every listener, is 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & os.environ.keys():
        # Token authentication, with a token of this run's own instead of ~/.ray/auth_token.
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        if "ray" in sys.modules:  # imported already (vLLM imports Ray): it read the old mode
            reload_ray_auth()


def reload_ray_auth() -> None:
    """Make an imported Ray read its authentication settings from the environment again (the
    order Ray's own tests use: the config first, then the token cache)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def start_ray(address: str | None = None, num_cpus: int = 0) -> bool:
    """Join the cluster at `address`, or start a Ray on this machine (`num_cpus`, 0: all cores).

    Returns False when this process is already connected to a Ray (the caller must then leave
    it running), True when this call started or joined one (the caller shuts it down)."""
    if not address:
        local_ray_env()
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return True
    global _reaper
    context = ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        _temp_dir=os.path.join(tempfile.gettempdir(), f"cadence-ray-{os.getuid()}"),
        logging_level=logging.WARNING,
    )
    session_dir = cast(Any, context).address_info["session_dir"]  # a RayContext, locally
    _reaper = ray_reaper.start(session_dir, os.path.dirname(ray.__file__))
    return True


def shutdown_ray() -> None:
    """Shut down the Ray that `start_ray` started or joined (the reaper then sweeps up any
    straggler of a local one)."""
    global _reaper
    import ray

    ray.shutdown()
    ray_reaper.stop(_reaper)
    _reaper = None


def ray_request(num_cpus: float, num_gpus: float, custom: dict[str, float]) -> dict[str, float]:
    """An actor's resources as Ray names them, the zero ones left out."""
    request = {"CPU": num_cpus, "GPU": num_gpus, **custom}
    return {name: amount for name, amount in request.items() if amount}


def missing(request: dict[str, float]) -> str | None:
    """None when a live node of the cluster has every resource of `request`; else what is
    missing, in words: the resources no live node has at all, or else that none has all of
    them in those amounts."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if any(all(node.get(k, 0.0) >= v for k, v in request.items()) for node in nodes):
        return None
    absent = sorted(k for k in request if not any(k in node for node in nodes))
    if absent:
        return f"no live node of the Ray cluster has the resource {', '.join(map(repr, absent))}"
    return f"no live node of the Ray cluster has {request} (live nodes: {len(nodes)})"


def on_driver_node() -> Any:
    """A scheduling strategy that puts an actor on the driver's node, and nowhere else."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
