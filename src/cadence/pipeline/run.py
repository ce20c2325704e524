"""A run's settings and components as the loop takes them, made by the builder (cadence.builder):
plain values and Protocols, never the config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.learner import Scorer, Trainer
from cadence.metrics import Tracer
from cadence.pipeline.checkpoint import Checkpoint
from cadence.pipeline.prompts import PromptStream
from cadence.pipeline.source import GroupSource


@dataclass(frozen=True)
class LoopParams:
    """What the loop needs to know of the configuration (made by `builder.loop_params`)."""

    iterations: int
    prompts_per_iteration: int
    max_staleness: int = 0  # versions a trained group may lag the learner
    eval_every: int = 0  # held-out accuracy every N iterations (0: before and after only)
    checkpoint_every: int = 0
    max_minutes: float = 0.0  # the loop stops after the iteration that ends past this (0: never)
    keep_checkpoints: int = 2
    max_error_fraction: float = 0.1  # reward errors a run tolerates
    mode: str = "sync"  # labels for the summary and the timeline
    placement: str = "colocated"
    slots: int = 256  # sequences an engine decodes at once: the timeline's scale for them
    tensorboard: bool = False
    progress: bool = True
    reference_path: str = ""  # recorded in checkpoints
    config_toml: str = ""  # the resolved configuration, written to `config.toml`
    save_merged: bool = False  # LoRA: also write final/merged/, the adapter merged in
    wandb: bool = False  # trackers: per-iteration figures, config, summary and timeline
    mlflow: bool = False
    # the sampler-learner gap a run tolerates (behaviour_logprob_abs_diff_mean; 0: not watched)
    # and what it does past it: "stop" or "warn"
    behaviour_gap_max: float = 0.0
    on_behaviour_gap: str = "stop"


@dataclass
class Run:
    """A run's components, wired (by `builder.build_run`)."""

    params: LoopParams
    tokenizer: Any
    trainer: Trainer  # one process, or learner.ranks torch.distributed ranks
    scorer: Scorer
    source: GroupSource
    heldout_accuracy: Callable[[], float]  # greedy accuracy of the current policy
    num_heldout: int  # problems it is measured on (for its standard error)
    stream: PromptStream
    tracer: Tracer
    resume: Checkpoint | None = None  # the checkpoint this run continues from
    reference_digest: str | None = None  # identity of the reference weights (for checkpoints)
    # `heldout_accuracy/<task>` of the last held-out measurement ({}: no task labels)
    heldout_tasks: Callable[[], dict[str, float]] = dict

    @property
    def first_iteration(self) -> int:
        return self.resume.iteration if self.resume else 0

    def close(self) -> None:
        """Stop the learner's ranks (if any), then the source's workers: the source may own the
        Ray that ranks on Ray run in."""
        try:
            self.trainer.close()
        finally:
            self.source.close()
