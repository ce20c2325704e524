"""Tracer counters: the time-weighted mean level of a counter over a window."""

import pytest

from cadence.metrics.trace import Tracer


def test_mean_level_weighs_each_value_by_how_long_it_held():
    tracer = Tracer()
    origin = tracer.origin
    # level 4 from t=0, 10 from t=2, 0 from t=3 (t in seconds since the tracer's origin)
    tracer.add_samples("rows waiting", "queue-reward", [(origin + 0.0, 4), (origin + 2.0, 10)])
    tracer.add_samples("slots", "worker-0", [(origin + 2.5, 99)])  # another track: ignored
    tracer.add_samples("rows waiting", "queue-reward", [(origin + 3.0, 0)])
    # window [1, 4]: 4 for 1 s, 10 for 1 s, 0 for 1 s -> 14 / 3
    assert tracer.mean_level("queue-reward", 1.0, 4.0) == pytest.approx(14 / 3)
    # window [2.5, 3.5]: 10 carried in for 0.5 s, then 0 -> 5
    assert tracer.mean_level("queue-reward", 2.5, 3.5) == pytest.approx(5.0)
    assert tracer.mean_level("queue-gen", 0.0, 1.0) == 0.0  # no samples: empty
    assert tracer.mean_level("queue-reward", 2.0, 2.0) == 10.0  # an empty window: the level
