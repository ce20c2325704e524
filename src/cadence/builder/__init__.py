"""The builder: the one place that reads the whole config and wires a run from it.

`build_run` makes every component of `cadence train` (`run.py`); the recipes that build parts of
a run (`bench`, `plan`, `study`, `cadence eval`, the CLI) import this face alone: the config's
translations into plain parameters (`params.py`), the refusals of settings that cannot run
together (`checks.py`), tasks, prompts and environments (`tasks.py`), and engines, workers and
held-out evaluation (`rollout.py`). The runtime it wires (`cadence.pipeline`) is config-blind.
"""

from cadence.builder.checks import (
    check_before_loading,
    check_group_size,
    check_sharded,
    learns_from_one_sample,
    max_prompt_tokens,
    model_positions,
    require_engine,
)
from cadence.builder.params import (
    algo_params,
    all_threads,
    engine_options,
    learner_params,
    learner_threads,
    loop_params,
    max_staleness,
    partial_rollouts,
    producer_params,
    rank_spec,
    reward_spec,
    sampling_params,
    set_threads,
    usable_cores,
    vllm_options,
    worker_spec,
)
from cadence.builder.rollout import (
    evaluate_model,
    heldout_evaluator,
    learner_engine,
    open_rollout_engine,
    rollout_worker,
    run_reward,
)
from cadence.builder.run import (
    build_learner,
    build_run,
    build_scorer,
    build_source,
    build_trainer,
    load_policy,
    reference_model,
    start_ranks,
)
from cadence.builder.tasks import (
    env_spec,
    heldout_set,
    make_task,
    prompt_filter,
    prompt_render,
    sft_segments,
    tokenizer_corpus,
)
from cadence.pipeline import train

__all__ = [
    "algo_params",
    "all_threads",
    "build_learner",
    "build_run",
    "build_scorer",
    "build_source",
    "build_trainer",
    "check_before_loading",
    "check_group_size",
    "check_sharded",
    "engine_options",
    "env_spec",
    "evaluate_model",
    "heldout_evaluator",
    "heldout_set",
    "learner_engine",
    "learner_params",
    "learner_threads",
    "learns_from_one_sample",
    "load_policy",
    "loop_params",
    "make_task",
    "max_prompt_tokens",
    "max_staleness",
    "model_positions",
    "open_rollout_engine",
    "partial_rollouts",
    "producer_params",
    "prompt_filter",
    "prompt_render",
    "rank_spec",
    "reference_model",
    "require_engine",
    "reward_spec",
    "rollout_worker",
    "run_reward",
    "sampling_params",
    "set_threads",
    "sft_segments",
    "start_ranks",
    "tokenizer_corpus",
    "train",
    "usable_cores",
    "vllm_options",
    "worker_spec",
]
