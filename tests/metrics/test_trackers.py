"""W&B (offline) and MLflow (a local file store) receive the per-iteration figures, the config,
the summary and the run's files; read back from what each library wrote, with no network."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from cadence.metrics.trackers import MlflowSink, WandbSink, flatten, scalars

CONFIG = {"train": {"lr": 0.001, "iterations": 2}, "model": {"lora": {"r": 8}}}
RECORDS = [
    {"iteration": 0, "reward_mean": 0.25, "kl": 0.0, "staleness_hist": [4], "x": float("nan")},
    {"iteration": 1, "reward_mean": 0.5, "kl": 0.01, "staleness_hist": [4], "x": 1.0},
]
SUMMARY = {"accuracy_before": 0.1, "accuracy_after": 0.3, "mode": "sync"}


def _run_files(out: Path) -> None:
    from cadence.metrics.timeline import draw_timeline

    draw_timeline([], out / "timeline.png", title="t")
    (out / "config.toml").write_text("[train]\nlr = 0.001\n")
    (out / "summary.json").write_text(json.dumps(SUMMARY))


def _drive(sink, out: Path) -> None:
    for r in RECORDS:
        sink.write(r)
    sink.close()
    _run_files(out)
    sink.finish(SUMMARY, out)


def test_scalars_and_flatten() -> None:
    assert scalars(RECORDS[0]) == {"iteration": 0.0, "reward_mean": 0.25, "kl": 0.0}
    assert flatten(CONFIG) == {"train.lr": 0.001, "train.iterations": 2, "model.lora.r": 8}


def test_mlflow_file_store_gets_metrics_params_summary_and_files(tmp_path, monkeypatch) -> None:
    import mlflow

    monkeypatch.chdir(tmp_path)  # the default store: ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "cadence-test")
    out = tmp_path / "run-a"
    out.mkdir()
    _drive(MlflowSink(out, CONFIG), out)
    client = mlflow.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("cadence-test").experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "x")] == [1]  # NaN left out
    assert run.data.params["train.lr"] == "0.001" and run.data.params["model.lora.r"] == "8"
    assert run.data.metrics["summary.accuracy_after"] == pytest.approx(0.3)
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert files == {"timeline.png", "config.toml", "summary.json"}


def test_mlflow_honours_the_users_tracking_uri_and_marks_failures(tmp_path, monkeypatch) -> None:
    import mlflow

    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    sink = MlflowSink(tmp_path / "run-b", CONFIG)
    sink.write(RECORDS[0])
    sink.finish(None, tmp_path)  # the run failed
    client = mlflow.MlflowClient(store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("cadence").experiment_id])
    assert run.info.status == "FAILED"


def _wandb_records(run_dir: Path):
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks
    of chunks with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_run_holds_history_config_summary_and_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "cadence-test")
    out = tmp_path / "run-c"
    out.mkdir()
    _drive(WandbSink(out, CONFIG), out)
    import wandb

    wandb.teardown()  # the run's log is written by wandb's service process: let it finish
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    history, config, summary = [], {}, {}
    for r in _wandb_records(run_dir):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "run":
            config |= {_key(i): json.loads(i.value_json) for i in r.run.config.update}
        elif kind == "summary":
            summary |= {_key(i): json.loads(i.value_json) for i in r.summary.update}
    steps = [(h["_step"], h["reward_mean"]) for h in history if "reward_mean" in h]
    assert steps == [(0, 0.25), (1, 0.5)]
    assert any(k.startswith("timeline") for h in history for k in h)
    assert config["train"] == {"lr": 0.001, "iterations": 2}
    assert summary["accuracy_after"] == 0.3
    files = {p.name for p in (run_dir / "files").iterdir()}
    assert {"timeline.png", "config.toml", "summary.json"} <= files
    assert list((run_dir / "files" / "media" / "images").glob("timeline_*.png"))
