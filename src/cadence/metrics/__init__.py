"""Metrics: sinks, spans, and the figures a run reports (TPSPD, pipeline and stage figures,
the summary). Nothing here runs the pipeline or reads the config."""

from cadence.metrics.figures import (
    TRAIN_SPANS,
    binomial_stderr,
    pipeline_figures,
    sample_figures,
    stage_figures,
    summary,
    tpspd,
)
from cadence.metrics.sinks import (
    ConsoleProgress,
    JsonlSink,
    MemorySink,
    MetricsSink,
    TensorBoardSink,
)
from cadence.metrics.tasks import task_accuracy, task_figures, task_summary
from cadence.metrics.trace import Sample, Span, Tracer

__all__ = [
    "TRAIN_SPANS",
    "ConsoleProgress",
    "JsonlSink",
    "MemorySink",
    "MetricsSink",
    "Sample",
    "Span",
    "TensorBoardSink",
    "Tracer",
    "binomial_stderr",
    "pipeline_figures",
    "sample_figures",
    "stage_figures",
    "summary",
    "task_accuracy",
    "task_figures",
    "task_summary",
    "tpspd",
]
