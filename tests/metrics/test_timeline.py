import json

import pytest

from cadence.metrics.timeline import chrome_trace, draw_timeline, order_tracks, write_chrome_trace
from cadence.metrics.trace import Sample, Span

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SPANS = [
    Span("generate", "worker-10", 0.0, 0.4),
    Span("generate", "worker-2", 0.1, 0.6),
    Span("train_step", "learner", 0.5, 1.25),
    Span("make_batch", "producer", 0.3, 0.5),
    Span("save", "checkpoint", 1.25, 1.5),
    Span("sync_weights", "learner", 1.25, 1.3),
]
# learner, producer, workers by number, then the rest alphabetically.
EXPECTED_ORDER = ["learner", "producer", "worker-2", "worker-10", "checkpoint"]


def _events(trace: dict, ph: str, name: str | None = None) -> list[dict]:
    return [
        e for e in trace["traceEvents"] if e["ph"] == ph and (name is None or e["name"] == name)
    ]


def test_chrome_trace_has_one_complete_event_per_span_in_microseconds():
    trace = chrome_trace(SPANS)
    complete = _events(trace, "X")
    assert len(complete) == len(SPANS)
    train = next(e for e in complete if e["name"] == "train_step")
    # 0.5 s -> 500_000 us; 1.25 s - 0.5 s = 0.75 s -> 750_000 us.
    assert train["ts"] == pytest.approx(500_000.0, abs=1e-6)
    assert train["dur"] == pytest.approx(750_000.0, abs=1e-6)
    assert train["cat"] == "learner"
    assert train["pid"] == 1
    assert trace["displayTimeUnit"] == "ms"


def test_chrome_trace_tids_follow_track_order():
    trace = chrome_trace(SPANS)
    names = {e["args"]["name"]: e["tid"] for e in _events(trace, "M", "thread_name")}
    assert sorted(names, key=names.get) == EXPECTED_ORDER
    assert names["learner"] == 0
    assert names["worker-2"] < names["worker-10"]
    for event in _events(trace, "X"):
        assert event["tid"] == names[event["cat"]]


def test_chrome_trace_metadata_names_and_sorts_every_track():
    trace = chrome_trace(SPANS)
    named = {e["args"]["name"] for e in _events(trace, "M", "thread_name")}
    assert named == {s.track for s in SPANS}
    sort_index = {
        e["tid"]: e["args"]["sort_index"] for e in _events(trace, "M", "thread_sort_index")
    }
    assert sort_index == {tid: tid for tid in range(len(EXPECTED_ORDER))}


def test_write_chrome_trace_round_trips_through_json(tmp_path):
    path = write_chrome_trace(SPANS, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == chrome_trace(SPANS)


@pytest.mark.parametrize("spans", [SPANS, []], ids=["spans", "empty"])
def test_draw_timeline_writes_a_png(tmp_path, spans):
    marks = [(0.0, "iteration start"), (1.25, "")]
    path = draw_timeline(spans, tmp_path / "timeline.png", marks=marks)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > len(PNG_SIGNATURE)


def test_reward_workers_then_queues_follow_the_rollout_workers():
    tracks = ["queue-train", "reward-10", "checkpoint", "worker-1", "reward-2", "learner"]
    assert order_tracks(tracks) == [
        "learner",
        "worker-1",
        "reward-2",
        "reward-10",
        "queue-train",
        "checkpoint",
    ]


def test_counters_of_several_names_draw_in_rows_of_their_own(tmp_path):
    spans = [Span("score", "reward-0", 0.0, 0.5), Span("generate", "worker-0", 0.0, 1.0)]
    samples = [
        Sample("slots", "worker-0", 0.0, 3.0),
        Sample("rows waiting", "queue-reward", 0.2, 8.0),
        Sample("rows waiting", "queue-reward", 0.6, 0.0),
    ]
    path = draw_timeline(spans, tmp_path / "t.png", samples=samples, capacity={"slots": 4})
    assert path.read_bytes().startswith(PNG_SIGNATURE)
