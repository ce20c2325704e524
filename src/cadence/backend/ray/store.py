"""The run's sample store in a Ray actor, for the Ray backend: the same `SampleStore` class,
constructed by the actor, behind a handle with the methods the pipeline calls. Nothing of the
store is written twice. The actor lives on the driver's node, whatever custom resources pin the
workers elsewhere. Ray is imported only inside methods (see `ray.cluster`)."""

from __future__ import annotations

from typing import Any


class ActorStore:
    """The run's `SampleStore`, living in a Ray actor, behind the methods the pipeline calls
    (each one remote call; the actor is threaded, so a `get` that waits does not block a `put`).
    The same class as in-process: nothing of the store is written twice."""

    def __init__(self, **kwargs: Any) -> None:
        import ray

        from cadence.backend.ray.cluster import on_driver_node
        from cadence.dataplane import SampleStore

        # on the learner's node: a worker node that is lost must not take the store with it
        strategy = on_driver_node()
        remote = ray.remote(SampleStore).options(
            num_cpus=0, max_concurrency=64, scheduling_strategy=strategy
        )
        self._actor = remote.remote(**kwargs)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args, **kwargs))
        except ray.exceptions.RayTaskError as e:  # the store's own exception, as raised there
            raise e.as_instanceof_cause() from None

    def put(self, rows, fields) -> None:
        self._call("put", rows, fields)

    def get(self, *args: Any, **kwargs: Any):
        return self._call("get", *args, **kwargs)

    def depth(self, *args: Any, **kwargs: Any) -> int:
        return self._call("depth", *args, **kwargs)

    def clear(self, iteration: int) -> int:
        return self._call("clear", iteration)

    def close(self) -> None:
        self._call("close")

    def stats(self) -> dict[str, Any]:
        return self._call("stats")
