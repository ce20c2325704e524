"""Metrics sinks, spans and run-level figures (TPSPD)."""

from cadence.metrics.sinks import (
    ConsoleProgress,
    JsonlSink,
    MemorySink,
    MetricsSink,
    TensorBoardSink,
)
from cadence.metrics.trace import Sample, Span, Tracer


def tpspd(num_tokens: float, wall_s: float, num_devices: int = 1) -> float:
    """Tokens per second per device: trained prompt + response tokens / (wall x devices)."""
    return num_tokens / max(wall_s, 1e-9) / max(num_devices, 1)


__all__ = [
    "ConsoleProgress",
    "JsonlSink",
    "MemorySink",
    "MetricsSink",
    "Sample",
    "Span",
    "TensorBoardSink",
    "Tracer",
    "tpspd",
]
