"""The data plane: samples as rows of a store, fields written by stages, taken once per task.

It owns the sample store (`SampleStore`, and the `Store` Protocol its Ray handle also meets),
its samplers (`in_order`, `LengthBalanced`), the staleness rule, and how a group becomes rows and
back. It knows nothing of iterations beyond the numbers on rows, of processes, or of the
learner; it imports only `cadence.types` (and, for type hints, the tracer).
"""

from cadence.dataplane.samplers import LengthBalanced, Sampler, in_order
from cadence.dataplane.samples import (
    GENERATED,
    LEARNER,
    REWARD,
    SCORE,
    SCORER,
    TEACH,
    TEACHER,
    TEACHER_LOGPROBS,
    TRAIN,
    batch_groups,
    group_rows,
    record_depths,
)
from cadence.dataplane.staleness import StaleRowError, check_staleness
from cadence.dataplane.store import SampleStore, Store, StoreClosed

__all__ = [
    "GENERATED",
    "LEARNER",
    "REWARD",
    "SCORE",
    "SCORER",
    "TEACH",
    "TEACHER",
    "TEACHER_LOGPROBS",
    "TRAIN",
    "LengthBalanced",
    "SampleStore",
    "Sampler",
    "StaleRowError",
    "Store",
    "StoreClosed",
    "batch_groups",
    "check_staleness",
    "group_rows",
    "in_order",
    "record_depths",
]
