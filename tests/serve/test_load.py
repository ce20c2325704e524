"""A short run of benchmarks/serve_load.py against the tiny model: many requests in flight for a
few seconds, valid and invalid mixed; every valid one answered, every invalid one a 4xx, and the
server healthy after."""

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import serve_load


@pytest.mark.slow
def test_under_load_every_valid_request_is_answered_and_every_invalid_one_is_4xx(
    make_server, start_server
):
    with start_server(make_server(max_num_seqs=64)) as url:
        report = asyncio.run(serve_load.run_load(url.removesuffix("/v1"), "sesame", 64, 2.0))
    assert report["num_problems"] == 0, report["problems"]
    assert report["valid"] >= 20 and report["valid_answered"] == report["valid"], report
    assert report["invalid"] >= 5 and report["invalid_4xx"] == report["invalid"], report
    statuses = {int(s) for s in report["statuses"]}
    assert 200 in statuses and 400 in statuses and statuses <= {200, 400, 401}, report
    assert report["health_after"] == 200
