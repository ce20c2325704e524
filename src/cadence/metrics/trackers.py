"""Experiment trackers: Weights & Biases (`metrics.wandb`) and MLflow (`metrics.mlflow`).

Read on: docs/data.md#trackers-metricswandb-metricsmlflow.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

RUN_FILES = ("timeline.png", "config.toml", "summary.json")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (lists such as `staleness_hist` are left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}."""
    flat: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat |= flatten(v, key + ".")
        else:
            flat[key] = v
    return flat


class WandbSink:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("metrics.wandb needs wandb: pip install 'cadence[wandb]'") from None
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "cadence"),
            name=out.name,
            dir=str(out),
            config=config,
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["iteration"]))

    def close(self) -> None:
        pass  # the run ends in `finish`, once the summary and the timeline exist

    def finish(self, summary: dict[str, Any] | None, out: Path) -> None:
        if summary is None:
            self.run.finish(exit_code=1)
            return
        self.run.summary.update(scalars(summary))
        timeline = out / "timeline.png"
        if timeline.is_file():
            self.run.log({"timeline": self._wandb.Image(str(timeline))})
        for name in RUN_FILES:
            if (out / name).is_file():
                self.run.save(str(out / name), base_path=str(out), policy="now")
        self.run.finish()


class MlflowSink:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        try:
            import mlflow
        except ImportError:
            raise RuntimeError(
                "metrics.mlflow needs MLflow: pip install 'cadence[mlflow]'"
            ) from None
        self._mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = Path("mlruns").resolve().as_uri()
        mlflow.set_tracking_uri(uri)  # explicitly: an earlier run in this process set its own
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "cadence"))
        self.run = mlflow.start_run(run_name=out.name)
        params = {k: str(v)[:500] for k, v in flatten(config).items()}  # MLflow's value limit
        mlflow.log_params(params)

    def write(self, record: dict[str, Any]) -> None:
        self._mlflow.log_metrics(scalars(record), step=int(record["iteration"]))

    def close(self) -> None:
        pass  # the run ends in `finish`

    def finish(self, summary: dict[str, Any] | None, out: Path) -> None:
        if summary is not None:
            self._mlflow.log_metrics({f"summary.{k}": v for k, v in scalars(summary).items()})
            for name in RUN_FILES:
                if (out / name).is_file():
                    self._mlflow.log_artifact(str(out / name))
        self._mlflow.end_run(status="FINISHED" if summary is not None else "FAILED")
