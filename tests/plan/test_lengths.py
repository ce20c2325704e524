"""Response-length distributions and the empirical loader."""

import json

import numpy as np
import pytest

from cadence.plan.lengths import LengthsError, ResponseLengths, load_empirical


def _rng():
    return np.random.default_rng(0)


def test_draws_are_integers_within_one_and_the_cap():
    for dist in [
        ResponseLengths("fixed", tokens=30),
        ResponseLengths("uniform", low=5, high=50),
        ResponseLengths("lognormal", mean=40, sigma=1.5),
    ]:
        x = dist.sample(_rng(), (3, 8, 4), cap=48)
        assert x.shape == (3, 8, 4) and x.dtype == np.int64
        assert x.min() >= 1 and x.max() <= 48


def test_lognormal_mean_and_long_tail():
    x = ResponseLengths("lognormal", mean=1000, sigma=1.0).sample(_rng(), (200_000,), cap=10**9)
    assert x.mean() == pytest.approx(1000, rel=0.02)
    assert np.median(x) == pytest.approx(1000 * np.exp(-0.5), rel=0.02)  # median < mean
    assert np.percentile(x, 99) > 5 * np.median(x)


def test_metrics_jsonl_gives_the_per_iteration_means_and_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"iteration": k, "response_tokens_mean": m} for k, m in enumerate([12.4, 13, 20])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "trace.json").write_text("{}")
    for path in (run / "metrics.jsonl", run, run / "trace.json"):
        dist = load_empirical(path)
        assert dist.values == (12, 13, 20)
        assert "per-iteration means" in dist.note
    x = dist.sample(_rng(), (100,), cap=15)
    assert set(np.unique(x)) <= {12, 13, 15}


def test_per_sample_lengths_are_preferred_over_means(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"response_lengths": [3, 4], "response_tokens_mean": 3.5}, {"response_tokens": 9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert load_empirical(path).values == (3, 4, 9)
    listed = tmp_path / "lengths.json"
    listed.write_text("[5, 6, 7]")
    assert load_empirical(listed).values == (5, 6, 7)
    plain = tmp_path / "lengths.txt"
    plain.write_text("8\n9\n")
    assert load_empirical(plain).values == (8, 9)


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "\n", "no response lengths"),
        ("bad.jsonl", "{}\nnot json\n", "bad.jsonl:2"),
        ("zero.json", "[0, 3]", ">= 1"),
    ],
)
def test_bad_length_files_are_named(tmp_path, name, text, needle):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(LengthsError, match=needle):
        load_empirical(path)


def test_trace_without_metrics_is_explained(tmp_path):
    (tmp_path / "trace.json").write_text("{}")
    with pytest.raises(LengthsError, match="span times"):
        load_empirical(tmp_path / "trace.json")
