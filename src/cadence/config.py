"""The run configuration: TOML files validated by pydantic, with dotted `--set` overrides.

Every field has a description; an unknown key or a bad value raises `ConfigError`, whose message
names the key and what is allowed (the CLI turns it into exit code 2). Only the CLI and the run
builder see the whole config; components take plain keyword arguments.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(_Section):
    r: int = Field(16, ge=1, description="Rank of each adapter's update B @ A.")
    alpha: float = Field(32.0, gt=0.0, description="Scale numerator: the update is alpha / r * BA.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear layers that get an adapter (module name suffixes, as "
        "peft matches them); one that matches no module of the model is an error.",
    )
    save_merged: bool = Field(
        False, description="Also write final/merged/: a whole model with the adapter merged in."
    )


class ModelConfig(_Section):
    path: str = Field("runs/sft", description="Local Hugging Face causal-LM directory to train.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    device: str = Field("cpu", description="Torch device for learner and colocated engine.")
    lora: LoraSettings | None = Field(
        None,
        description="Train a LoRA adapter (peft) instead of every weight: {r, alpha, dropout, "
        "target_modules}. The reference is the same model with the adapter disabled; rollout "
        "workers receive merged weights; final/ holds the adapter (save_merged: and the model).",
    )


class ReasoningGymDataset(_Section):
    weight: float = Field(
        1.0,
        gt=0.0,
        description="This dataset's share of the mix: each row picks a dataset with probability "
        "weight / (sum of the weights), as reasoning-gym's DatasetSpec weights do.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the dataset's own config class in reasoning-gym (for "
        "chain_sum: min_terms, max_terms, min_digits, max_digits, allow_negation); a key the "
        "dataset does not have is an error when the task is built. Not seed or size: "
        "data.reasoning_gym sets them for every dataset.",
    )

    @model_validator(mode="after")
    def _no_seed_or_size(self) -> ReasoningGymDataset:
        for key in ("seed", "size"):
            if key in self.config:
                raise ValueError(
                    f"config.{key} is set by data.reasoning_gym.{key} for every dataset (a "
                    "dataset's own seed would hold out rows that training draws too): leave it out"
                )
        return self


class ReasoningGymConfig(_Section):
    datasets: dict[str, ReasoningGymDataset] = Field(
        ...,
        min_length=1,
        description="The mix: reasoning-gym dataset name -> { weight = 1.0, config = { ... } } "
        "(reasoning-gym's own `datasets` table, as its TRL and verl examples write it). Each "
        "row's reward is its dataset's own score_answer (reward.function 'reasoning_gym').",
    )
    size: int = Field(
        1000,
        ge=1,
        description="Training rows drawn from the mix (reasoning-gym's dataset_size); each epoch "
        "visits every one once, in an order shuffled by the seed. Rows whose question is held "
        "out are dropped.",
    )
    seed: int | None = Field(
        None,
        description="Seed of the training rows and their order (default: train.seed). The "
        "held-out rows are drawn with a seed hashed from data.seed, so they never coincide with "
        "training rows.",
    )
    developer_prompt: str | None = Field(
        None,
        description="The system message of every prompt: a name of reasoning-gym's "
        "SYSTEM_PROMPTS ('DeepSeekZero', 'default', 'simple', 'direct', 'chain_of_draft': they "
        "ask for the answer in <answer> tags) or the text itself. Needs data.chat_template; "
        "instead of data.system_prompt.",
    )


class DataConfig(_Section):
    task: Literal["arithmetic", "gsm8k", "dataset", "reasoning_gym"] = Field(
        "arithmetic",
        description="Task family: procedural arithmetic; gsm8k (GSM8K-format rows: question, "
        "answer ending in '#### x'); dataset (any local data set, columns named by prompt_field "
        "and answer_field); reasoning_gym (a weighted mix of reasoning-gym's procedural "
        "datasets, [data.reasoning_gym]; needs the 'reasoning-gym' extra).",
    )
    reasoning_gym: ReasoningGymConfig | None = Field(
        None,
        description="Task 'reasoning_gym': the table { datasets = { name = { weight, config } }, "
        "size, seed, developer_prompt }.",
    )
    path: str | None = Field(
        None,
        description="'gsm8k' and 'dataset': a local JSONL, JSON, parquet or CSV file, a "
        "save_to_disk directory, or a folder of data files named by split (train-*.parquet, "
        "test.jsonl, as a hub download leaves them). Never a hub id: download first.",
    )
    heldout_path: str | None = Field(
        None,
        description="Held-out data for 'gsm8k' and 'dataset' (any form `path` takes); default: "
        "heldout_split, heldout_fraction, or else the last num_heldout rows.",
    )
    split: str = Field("train", description="'gsm8k' and 'dataset': the split trained on.")
    heldout_split: str | None = Field(
        None, description="The held-out split of `path` (or of heldout_path), e.g. 'test'."
    )
    heldout_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Without a held-out split or path: hold out this fraction of the rows (a "
        "seeded draw; 0: the last num_heldout rows).",
    )
    prompt_field: str = Field(
        "question",
        description="'dataset': the column holding the prompt: a string, or a conversation (a "
        "list of {role, content} messages in OpenAI format, ending with the user's turn; needs "
        "chat_template).",
    )
    answer_field: str = Field(
        "answer",
        description="'dataset': the column holding the reference (a number, an expression, or a "
        "worked solution whose final answer reward.answer_format extracts).",
    )
    chat_template: bool | str = Field(
        False,
        description="true: render every prompt with the tokenizer's chat template (system_prompt, "
        "then the user's message, then the assistant's turn begins); a path: a Jinja template "
        "file to use instead of the tokenizer's; false: prompt_template as plain text. With "
        "env.kind 'verifiers': true renders every turn with verifiers' renderer for the model, "
        "false with cadence's plain one (texts concatenated, <call> syntax for tools).",
    )
    system_prompt: str | None = Field(
        None, description="chat_template: a system message put before every prompt's messages."
    )
    difficulty: int = Field(1, ge=1, le=3, description="Arithmetic difficulty, 1 (easiest)-3.")
    max_operand: int | None = Field(
        None, ge=2, description="Largest arithmetic operand (default: the difficulty's range)."
    )
    num_heldout: int = Field(200, ge=1, description="Held-out examples for accuracy (at most).")
    seed: int = Field(
        0,
        description="Seed of the held-out split (task 'arithmetic' or 'reasoning_gym', or a data "
        "set's heldout_fraction): fixed whatever train.seed, so runs with different seeds are "
        "measured on the same problems.",
    )
    prompt_template: str = Field(
        "Question: {question}\nAnswer: ",
        description="Prompt text; {question} is replaced. With chat_template, the user's message "
        "(default there: '{question}').",
    )
    on_bad_line: Literal["error", "skip"] = Field(
        "error", description="Malformed row or line: stop with file:line, or skip and count."
    )

    @model_validator(mode="before")
    @classmethod
    def _chat_prompt_template(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("chat_template") and "prompt_template" not in data:
            data["prompt_template"] = "{question}"
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        files = self.task in ("gsm8k", "dataset")
        if files and not self.path:
            raise ValueError(f"data.path is required when data.task = '{self.task}'")
        self._reasoning_gym()
        refused = {
            "dataset": (),
            "gsm8k": DATASET_ONLY,
            "arithmetic": DATASET_ONLY + FILES_ONLY,
            "reasoning_gym": (),  # its own check, `_reasoning_gym`
        }
        for key in refused[self.task]:
            if getattr(self, key) != DataConfig.model_fields[key].default:
                tasks = "'dataset'" if key in DATASET_ONLY else "'dataset' and 'gsm8k'"
                raise ValueError(
                    f"data.{key} applies to data.task = {tasks} only, not '{self.task}': "
                    "leave it out"
                )
        if self.heldout_fraction and (self.heldout_split or self.heldout_path):
            raise ValueError(
                "data.heldout_fraction draws the held-out rows from data.path; data.heldout_split "
                "and data.heldout_path name them: set one of the two ways"
            )
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError("data.system_prompt is a chat message: set data.chat_template = true")
        if self.chat_template == "":
            raise ValueError("data.chat_template is true, false, or a Jinja template file's path")
        return self

    def _reasoning_gym(self) -> None:
        """[data.reasoning_gym] with task 'reasoning_gym', and none of the other tasks' keys."""
        if self.task != "reasoning_gym":
            if self.reasoning_gym is not None:
                raise ValueError(
                    "data.reasoning_gym applies to data.task = 'reasoning_gym' only: set the task "
                    "or leave the table out"
                )
            return
        if self.reasoning_gym is None:
            raise ValueError(
                "data.task = 'reasoning_gym' needs a [data.reasoning_gym] table: datasets = "
                "{ name = { weight = 1.0, config = { ... } } }, size, seed"
            )
        for key in NOT_REASONING_GYM:
            if getattr(self, key) != DataConfig.model_fields[key].default:
                raise ValueError(
                    f"data.{key} does not apply to data.task = 'reasoning_gym' (its rows come from "
                    "[data.reasoning_gym]): leave it out"
                )
        if self.reasoning_gym.developer_prompt is not None:
            if self.system_prompt is not None:
                raise ValueError(
                    "data.reasoning_gym.developer_prompt and data.system_prompt both set the "
                    "system message: set one"
                )
            if self.chat_template is False:
                raise ValueError(
                    "data.reasoning_gym.developer_prompt is a system message: set "
                    "data.chat_template = true"
                )


DATASET_ONLY = ("prompt_field", "answer_field")
FILES_ONLY = ("split", "heldout_split", "heldout_fraction")
NOT_REASONING_GYM = (
    *DATASET_ONLY,
    *FILES_ONLY,
    "path",
    "heldout_path",
    "difficulty",
    "max_operand",
)

# vLLM arguments cadence sets itself (engine/vllm.py): not for rollout.vllm.engine_args
VLLM_RESERVED_ARGS = ("model", "tokenizer", "seed", "logprobs_mode", "max_num_seqs", "max_logprobs")


class VLLMConfig(_Section):
    """`[rollout.vllm]`: each key is the vLLM engine argument of the same name."""

    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of the GPU's memory vLLM takes (weights, activations, KV cache); "
        "lower it when the learner shares the GPU (placement 'colocated'). On CPU the KV cache "
        "is VLLM_CPU_KVCACHE_SPACE GiB instead (cadence's default: 1).",
    )
    enforce_eager: bool = Field(
        False,
        description="Run the model eagerly: no torch.compile, no CUDA graphs (a faster start, "
        "slower decoding on a GPU).",
    )
    max_model_len: int = Field(
        0, ge=0, description="Longest prompt + response vLLM plans for (0: the model's own)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations in vLLM (auto: model.dtype)."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the keys and values of whole blocks of a prompt across its G samples "
        "(emptied at each weight update).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine's model is split across (vLLM's own workers)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument by its name (e.g. block_size, "
        "kv_cache_dtype, swap_space), passed as given; checked when the engine starts.",
    )

    @model_validator(mode="after")
    def _no_owned_args(self) -> VLLMConfig:
        for key in self.engine_args:
            if key in VLLM_RESERVED_ARGS:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} is set by cadence (model path, per-sample "
                    "seeds, behaviour log-probs, rollout.max_num_seqs): leave it out"
                )
            if key in VLLMConfig.model_fields:
                raise ValueError(
                    f"rollout.vllm.engine_args.{key} has a key of its own: set rollout.vllm.{key}"
                )
        return self


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=1, description="Responses sampled per prompt (G).")
    max_new_tokens: int = Field(48, ge=1, description="Longest response, in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always).")
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Extra token ids a response stops at (kept in it). Always stopped at: the "
        "tokenizer's EOS and the model's generation_config.json eos_token_id (an int or a list: "
        "a chat model's end-of-turn token).",
    )
    max_prompt_tokens: int = Field(
        0,
        ge=0,
        description="Longest prompt, in tokens; see on_long_prompt. 0: what the model takes "
        "(its max_position_embeddings, or rollout.vllm.max_model_len where that is lower) minus "
        "max_new_tokens, or with env.kind = 'tool' minus env.max_total_tokens (a whole "
        "episode). A value over that is refused: prompt and response always fit.",
    )
    on_long_prompt: Literal["skip", "truncate"] = Field(
        "skip",
        description="A prompt over max_prompt_tokens: skip it (the next example takes its place) "
        "or keep its last max_prompt_tokens tokens; counted as prompts_skipped / "
        "prompts_truncated in metrics.jsonl.",
    )
    max_num_seqs: int = Field(
        256, ge=1, description="Most sequences an engine decodes at once (its slots)."
    )
    engine: Literal["continuous", "static", "vllm"] = Field(
        "continuous",
        description="continuous: a finished sequence's slot is refilled at once and each group "
        "leaves as soon as it is complete; static: batches that end with their slowest sequence; "
        "vllm: vLLM's engine (paged attention, CUDA graphs, prefix cache, tensor parallelism), "
        "set up by [rollout.vllm]; needs the 'vllm' extra (docs/engines.md).",
    )
    vllm: VLLMConfig = Field(
        default_factory=lambda: VLLMConfig(), description="engine 'vllm': its settings."
    )

    @model_validator(mode="after")
    def _vllm_keys_for_vllm(self) -> RolloutConfig:
        if self.engine != "vllm" and self.vllm != VLLMConfig():
            raise ValueError(
                f"rollout.vllm applies to rollout.engine = 'vllm' only, not '{self.engine}': "
                "set the engine or leave [rollout.vllm] out"
            )
        return self


class RewardConfig(_Section):
    kind: Literal["rule", "model"] = Field(
        "rule",
        description="rule: `function` scores each response; model: a learned reward model "
        "(`model_path`) scores responses in micro-batches of `batch_size`, in reward workers.",
    )
    function: str = Field(
        "math",
        description="'math' (math-verify final answer), 'reasoning_gym' (each row's own "
        "reasoning-gym score_answer, in [0, 1]; the default when data.task = 'reasoning_gym') or "
        "'module:function' (fn(prompt, completion, answer) -> float, or an `async def` one; a "
        "`metadata` keyword or **kwargs also gets the row's metadata). With kind 'model' it "
        "still scores held-out accuracy.",
    )
    model_path: str | None = Field(
        None,
        description="kind 'model': local Hugging Face sequence-classification directory "
        "(`cadence init-reward-model` builds a tiny one on the task).",
    )
    stage: Literal["worker", "separate"] = Field(
        "worker",
        description="Where responses are scored: worker (inside the rollout worker, as each group "
        "finishes; rule rewards only) or separate (a stage of num_workers reward worker processes "
        "that score rows from the sample store as they arrive; needs pipeline.placement = "
        "'separate'). Default: worker for kind 'rule', separate for kind 'model'.",
    )
    num_workers: int = Field(1, ge=1, description="stage 'separate': reward worker processes.")
    threads_per_worker: int = Field(
        1, ge=1, description="stage 'separate': torch threads in each reward worker."
    )
    batch_size: int = Field(
        32,
        ge=1,
        description="stage 'separate': most responses a reward worker takes at once (it takes "
        "whatever has arrived, up to this); kind 'model': also responses per forward pass.",
    )
    max_error_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Stop the run (exit 1) when more reward calls than this fraction fail (raise, "
        "return NaN or time out): checked after each iteration once 64 calls were made, and at "
        "the end of the run however few; a run whose every call so far failed stops after its "
        "first iteration. 1 tolerates every failure.",
    )
    timeout_s: float = Field(
        10.0,
        ge=0.0,
        description="Longest a rule reward call may take, in any process or thread: past it the "
        "call scores 0 and counts as a reward error (and in reward_timeouts); 0: no limit.",
    )
    concurrency: int | None = Field(
        None,
        ge=1,
        description="Most rule reward calls in flight at once in each process that scores (a "
        "rollout worker, held-out evaluation, each reward worker): an `async def` reward is "
        "awaited on one event loop per process, a plain one runs in threads (at 1, in the "
        "calling thread, as before). A group is scored while the engine decodes the others; "
        "results keep their order, so the values do not depend on it; each call keeps its own "
        "reward.timeout_s. Unset: the reward's own `concurrency` attribute (1 for 'math' and "
        "'reasoning_gym', which compute rather than wait), else 32.",
    )
    answer_format: Literal["hashes", "boxed", "last_number", "auto"] = Field(
        "auto",
        description="function 'math': the graded part of a completion and of the reference: the "
        "line after the last '####', the last \\boxed{...}, the last number, or auto (whichever "
        "of '####' and \\boxed{ comes last, else the whole text). A plain-number reference cuts "
        "the prediction to its last number. function 'reasoning_gym': auto is reasoning-gym's "
        "own rule, the last <answer>...</answer>; the others as for 'math' (no marker: no "
        "answer, score 0).",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong penalty: over the last overlong_buffer tokens before "
        "the episode's cap on policy tokens (rollout.max_new_tokens single-turn; with tools the "
        "smaller of env.max_turns x rollout.max_new_tokens and env.max_total_tokens) a "
        "response's reward falls linearly by up to overlong_penalty. Counts the tokens the "
        "policy wrote, never tool replies. Applied by the learner before advantages, whatever "
        "the reward stage; reward_mean stays the raw reward, reward_shaped_mean is the shaped "
        "one. 0: off.",
    )
    overlong_penalty: float = Field(
        1.0, ge=0.0, description="The overlong penalty at the episode's cap (DAPO: 1)."
    )

    @model_validator(mode="before")
    @classmethod
    def _stage_of_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stage" not in data:
            data["stage"] = "separate" if data.get("kind") == "model" else "worker"
        return data

    @model_validator(mode="after")
    def _model_path_for_model(self) -> RewardConfig:
        if self.kind == "model" and not self.model_path:
            raise ValueError("reward.model_path is required when reward.kind = 'model'")
        if self.kind == "model" and self.stage != "separate":
            raise ValueError(
                "reward.kind = 'model' runs in reward workers: set reward.stage = 'separate' "
                "(or leave it out)"
            )
        return self


class AlgoConfig(_Section):
    loss: Literal["ppo_clip", "pg", "rloo", "online_dpo", "gspo", "cispo"] = Field(
        "ppo_clip",
        description="Loss (registry name): ppo_clip (clipped surrogate), pg (REINFORCE), rloo "
        "(REINFORCE with leave-one-out advantages), online_dpo (each group's best vs worst "
        "response, against the frozen reference), gspo (one clipped geometric-mean ratio per "
        "sequence; loss_agg 'seq-mean' unless set), cispo (REINFORCE weighted by the clipped, "
        "detached ratio).",
    )
    advantage: Literal["grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline"] = (
        Field(
            "grpo",
            description="Advantage estimator (registry name). reinforce_pp: REINFORCE++, rewards "
            "normalised over the whole batch's tokens; reinforce_pp_baseline: each group's mean "
            "subtracted first. With loss 'rloo' it must be 'rloo' (the default there); "
            "online_dpo uses none.",
        )
    )
    scale_by_std: bool = Field(True, description="GRPO: divide by the group's reward std.")
    std: Literal["unbiased", "population"] = Field(
        "unbiased",
        description="GRPO and REINFORCE++: the std divides by n - 1 (unbiased, verl's and TRL's) "
        "or by n (population, which makes GRPO's advantages sqrt(G / (G - 1)) larger).",
    )
    std_eps: float = Field(
        1e-4,
        ge=0.0,
        description="Added to that std (TRL's 1e-4; verl's is 1e-6): reward differences far "
        "below it stay far below 1 in advantage. Set it to the reward's resolution.",
    )
    clip_low: float = Field(
        0.2, ge=0.0, le=1.0, description="Ratio floor is 1 - clip_low (1: no floor)."
    )
    clip_high: float = Field(0.2, ge=0.0, description="Ratio ceiling is 1 + clip_high.")
    clip_ratio_c: float = Field(
        0.0,
        ge=0.0,
        description="Dual-clip PPO (loss 'ppo_clip'): a token with a negative advantage A has a "
        "loss of at most -A * clip_ratio_c (> 1; verl's default is 3). 0: off.",
    )
    mask_truncated: bool = Field(
        False,
        description="Drop responses cut at their length cap (finish_reason 'length') from "
        "the loss (TRL's mask_truncated_completions): they train no token but still count in "
        "their group's advantages and, like empty responses, in seq-mean's number of sequences.",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL(policy || reference).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    kl_clamp: float = Field(
        0.0,
        ge=0.0,
        description="Cap on each token's k3 estimate, with zero gradient beyond it (verl caps "
        "at 10); 0: no cap (TRL's). Its log-ratio is clamped to [-20, 20] either way.",
    )
    loss_agg: Literal["token-mean", "seq-mean", "seq-sum-norm"] = Field(
        "token-mean",
        description="Loss aggregation over the global batch (online_dpo: the mean over pairs); "
        "seq-sum-norm divides by the number of sequences times the episode's cap on policy "
        "tokens (see reward.overlong_buffer).",
    )
    rollout_correction: Literal[
        "none",
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "sequence_mask",
        "geometric_mask",
        "icepop",
    ] = Field(
        "none",
        description="Correct for the gap between the engine that sampled (its behaviour "
        "log-probs) and the learner: each token's policy-gradient term is multiplied by a weight "
        "of rho = pi_old / pi_behaviour (see correction_proximal), band [lo, hi] = "
        "[correction_clip_min, correction_clip_max]. token_truncate: clip(rho_t, lo, hi); "
        "token_mask: rho_t inside the band, else 0; icepop: the same as token_mask (IcePop's "
        "name, from the Ring-1T report); sequence_truncate / sequence_mask: the same with "
        "the sequence's product of token ratios; geometric_mask: 1 if the geometric mean of the "
        "sequence's token ratios is inside the band, else 0 (verl's Geo-RS). TRL's default is "
        "sequence_mask with hi = 3. Formulas, defaults and verl/TRL names: docs/corrections.md.",
    )
    correction_clip_min: float = Field(
        0.0,
        ge=0.0,
        description="rollout_correction: the band's lower end (0: no lower bound, TRL's "
        "default); the band must hold 1.",
    )
    correction_clip_max: float = Field(
        3.0,
        gt=0.0,
        description="rollout_correction: the band's upper end (TRL's default, 3); the band must "
        "hold 1.",
    )
    correction_proximal: Literal["decoupled", "bypass"] = Field(
        "decoupled",
        description="The proximal policy. decoupled: old log-probs are the learner's policy at "
        "the iteration's start and the correction weighs by pi_old / pi_behaviour on top of the "
        "loss's pi / pi_old. bypass: old log-probs are the engine's behaviour log-probs (no old "
        "pass, no frozen old copy, for every row), the correction acts on pi / pi_behaviour, and "
        "a loss with a ratio (ppo_clip, gspo, cispo) takes only its mask (verl's bypass_mode).",
    )
    tis_cap: float = Field(
        0.0,
        ge=0.0,
        description="The older name of rollout_correction = 'token_truncate' with "
        "correction_clip_max = tis_cap (min(pi_old / pi_behaviour, tis_cap) per token; the same "
        "numbers); 0 leaves it unset, else >= 1. Not together with the rollout_correction and "
        "correction_* keys.",
    )
    dpo_beta: float = Field(
        0.1, gt=0.0, description="online_dpo: beta of DPO (tau of IPO), the pull to the reference."
    )
    dpo_loss: Literal["sigmoid", "ipo", "ipo_token_mean"] = Field(
        "sigmoid",
        description="online_dpo: sigmoid (DPO), ipo (IPO on summed sequence log-ratios: the "
        "paper's, TRL's OnlineDPOTrainer's) or ipo_token_mean (IPO on per-token mean "
        "log-ratios: TRL's DPOTrainer's).",
    )

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregation(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss") == "gspo":
            data.setdefault("loss_agg", "seq-mean")  # GSPO's objective: the mean over sequences
        return data

    @model_validator(mode="before")
    @classmethod
    def _rloo_advantage(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("loss") != "rloo":
            return data
        advantage = data.setdefault("advantage", "rloo")
        if advantage != "rloo":
            raise ValueError(
                f"algo.loss = 'rloo' computes leave-one-out advantages itself; "
                f"algo.advantage = {advantage!r} would be ignored: set it to 'rloo' or leave it out"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgoConfig:
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(
                f"algo.tis_cap must be 0 (off) or >= 1 (a cap below 1 shrinks the weight of "
                f"on-policy tokens); got {self.tis_cap}"
            )
        corrects = self.tis_cap > 0 or self.rollout_correction != "none"
        if self.loss == "online_dpo" and (
            self.kl_coef > 0 or corrects or self.correction_proximal != "decoupled"
        ):
            raise ValueError(
                "algo.loss = 'online_dpo' takes no algo.kl_coef or algo.tis_cap, nor a rollout "
                "correction (dpo_beta pulls towards the reference; there is no importance ratio): "
                "set both to 0, algo.rollout_correction = 'none' and algo.correction_proximal = "
                "'decoupled'"
            )
        self._check_correction()
        if self.clip_ratio_c != 0 and self.clip_ratio_c <= 1:
            raise ValueError(
                f"algo.clip_ratio_c must be 0 (off) or > 1 (the dual clip bounds the loss of a "
                f"negative advantage at -A * clip_ratio_c); got {self.clip_ratio_c}"
            )
        if self.clip_ratio_c > 0 and self.loss != "ppo_clip":
            raise ValueError(
                f"algo.clip_ratio_c is dual-clip PPO: it applies to algo.loss = 'ppo_clip' only, "
                f"not '{self.loss}'; set algo.clip_ratio_c = 0"
            )
        if self.mask_truncated and self.loss == "online_dpo":
            raise ValueError(
                "algo.mask_truncated would leave online_dpo pairs with an empty response: "
                "set algo.mask_truncated = false (or reward.overlong_buffer to penalise length)"
            )
        return self

    def _check_correction(self) -> None:
        # compared with the defaults, not by what was set: a written-out config sets every key
        newer = [
            k
            for k in ("rollout_correction", "correction_clip_min", "correction_clip_max")
            if getattr(self, k) != type(self).model_fields[k].default
        ]
        if self.tis_cap > 0 and newer:
            raise ValueError(
                f"algo.tis_cap = {self.tis_cap} is the older name of algo.rollout_correction = "
                f"'token_truncate' with algo.correction_clip_max = {self.tis_cap}: set "
                f"{', '.join('algo.' + k for k in newer)} or algo.tis_cap, not both"
            )
        low, high = self.correction_clip_min, self.correction_clip_max
        if low > high:
            raise ValueError(
                f"algo.correction_clip_min = {low} is above algo.correction_clip_max = {high}: "
                "the band [correction_clip_min, correction_clip_max] would be empty"
            )
        if not low <= 1.0 <= high:
            raise ValueError(
                f"the band [algo.correction_clip_min, algo.correction_clip_max] = [{low}, {high}] "
                "must hold 1: a token the learner's own policy sampled has ratio 1, and a band "
                "without it would cut or shrink every on-policy token"
            )
        truncate = self.rollout_correction in ("token_truncate", "sequence_truncate")
        ratio_loss = self.loss in ("ppo_clip", "gspo", "cispo")
        if self.correction_proximal == "bypass" and truncate and ratio_loss:
            raise ValueError(
                f"algo.rollout_correction = '{self.rollout_correction}' with "
                f"algo.correction_proximal = 'bypass' and algo.loss = '{self.loss}' would change "
                "nothing: the loss's own ratio pi / pi_behaviour is the importance weight "
                "(clipped by clip_low / clip_high). Use a *_mask mode, correction_proximal = "
                "'decoupled', or algo.loss = 'pg' or 'rloo'"
            )


class TrainConfig(_Section):
    iterations: int = Field(100, ge=1, description="Optimizer rounds (policy versions).")
    seed: int = Field(0, description="Run seed: data order, sampling seeds, initialisation.")
    prompts_per_iteration: int = Field(16, ge=1, description="Groups per iteration.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate.")
    warmup_iterations: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over the first N optimizer steps."
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    micro_batch_groups: int = Field(4, ge=1, description="Groups per forward/backward.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per iteration.")
    eval_every: int = Field(0, ge=0, description="Held-out eval every N iterations (0: ends).")
    threads: int = Field(0, ge=0, description="torch threads (0: all cores).")
    checkpoint_every: int = Field(
        10,
        ge=0,
        description="Write a checkpoint (policy, optimizer, RNG, data cursor, version, metrics "
        "offset) every N iterations and at the end, for `cadence train --resume`; 0: never.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    max_bad_steps: int = Field(
        3,
        ge=0,
        description="An optimizer step whose loss or gradient is NaN or inf is skipped (weights "
        "untouched) and counted; one more than this many in a row stops the run.",
    )


class LearnerConfig(_Section):
    shared_prompt: bool = Field(
        True,
        description="Pack each group as [prompt | r1 | ... | rG] so its prompt is computed once "
        "for its G responses (same log-probs as the unpacked forward).",
    )
    shared_prompt_impl: Literal["prefix", "dense"] = Field(
        "prefix",
        description="prefix: run the prompts once and let the responses attend to their keys and "
        "values (no quadratic mask; the faster); dense: one row per group with a 4-D mask.",
    )
    reuse_old_logprobs: bool = Field(
        True,
        description="Before an iteration's first optimizer step the old policy is the policy: use "
        "its log-probs detached instead of a pass of the frozen old copy.",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="Learner ranks: 1 trains in the driver process; N > 1 trains as N "
        "torch.distributed processes (gloo on CPU, NCCL on GPUs; local processes, or Ray actors "
        "with pipeline.backend = 'ray'), each on its share of every iteration's groups, one "
        "optimizer step together: the same update as one rank.",
    )
    strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="With ranks > 1: fsdp (FSDP2: parameters, gradients and optimizer state "
        "sharded per decoder layer across the ranks) or ddp (each rank a whole replica, "
        "gradients all-reduced).",
    )
    threads_per_rank: int = Field(
        0, ge=0, description="torch threads of each rank (0: the learner's threads / ranks)."
    )
    num_cpus_per_rank: float = Field(
        1.0, ge=0, description="ray: CPUs each learner rank actor reserves (Ray's num_cpus)."
    )
    num_gpus_per_rank: float = Field(
        0.0,
        ge=0,
        description="ray: GPUs each learner rank actor reserves; above 0 the ranks train on "
        "their GPU over NCCL.",
    )
    ray_rank_resources: dict[str, float] = Field(
        default_factory=dict,
        description="ray: custom Ray resources each learner rank actor reserves besides its CPUs "
        "and GPUs, e.g. { trainer = 1 }: the ranks then run only on nodes started with that "
        "resource (`ray start --resources='{\"trainer\": 2}'`). Names a node's role; {}: any "
        "node with the CPUs and GPUs.",
    )


class PipelineConfig(_Section):
    mode: Literal["sync", "periodic", "offpolicy"] = Field(
        "sync",
        description="sync: train once the whole batch is generated; periodic: train on groups as "
        "they finish, weights synced once per iteration (on-policy, same update as sync); "
        "offpolicy: generation runs up to max_staleness policy versions ahead of the learner.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="offpolicy: most versions a trained group may lag the learner (admission "
        "control: no prompt starts that could exceed it). 1 = one-step off-policy; 0 = periodic.",
    )
    partial_rollout: bool = Field(
        False,
        description="offpolicy: workers load each new version between two decode steps instead "
        "of waiting until their sequences finish; a sequence in flight goes on under the new "
        "weights and each token records the version that sampled it (token_versions). "
        "max_staleness then bounds a trajectory's oldest token. Continuous or vLLM engine "
        "(vLLM: keep only), single-turn only (docs/partial-rollouts.md).",
    )
    partial_rollout_kv: Literal["keep", "recompute"] = Field(
        "keep",
        description="partial_rollout: what a sequence in flight keeps when new weights arrive: "
        "keep (the keys and values computed under the old weights, PipelineRL) or recompute "
        "(prefill prompt and tokens so far again under the new weights, AReaL and verl; "
        "continuous engine only).",
    )
    staleness_strategy: Literal["drop", "wait"] = Field(
        "drop",
        description="A trajectory whose oldest token is more than max_staleness versions behind: "
        "drop (the learner drops it and counts it in dropped_groups, as without partial "
        "rollouts) or wait (partial_rollout: a worker defers new weights while loading them "
        "would leave such a trajectory in flight; verl's max_off_policy_strategy).",
    )
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: generate with the learner's own weights in its thread; "
        "separate: num_workers inference worker processes.",
    )
    num_workers: int = Field(1, ge=1, description="Inference worker processes (separate).")
    threads_per_worker: int = Field(1, ge=1, description="torch threads in each worker.")
    learner_threads: int = Field(
        0, ge=0, description="torch threads of the learner when separate (0: cores - workers)."
    )
    prompts_per_task: int = Field(
        4, ge=1, description="Prompts sent to a worker as one task (the unit of assignment)."
    )
    tasks_in_flight: int = Field(
        2, ge=1, description="Tasks queued at each worker at once (bounded concurrency)."
    )
    queue_size: int = Field(
        0,
        ge=0,
        description="periodic: most groups waiting in the sample store for the learner; while "
        "that many wait, the producer hands out no new task (0: no bound).",
    )
    filter_groups: Literal["none", "zero_variance"] = Field(
        "none",
        description="Dynamic sampling (DAPO): zero_variance trains no group whose rewards are all "
        "equal and draws one more prompt for each such group, until the iteration has "
        "train.prompts_per_iteration informative groups (or max_oversample extra prompts were "
        "drawn; then the earliest filtered groups fill the iteration). Periodic still equals "
        "sync. Counted as filtered_groups and oversampled_prompts in metrics.jsonl.",
    )
    max_oversample: int = Field(
        128,
        ge=0,
        description="filter_groups: most prompts drawn beyond train.prompts_per_iteration in one "
        "iteration.",
    )
    worker_timeout_s: float = Field(
        300.0, gt=0, description="Longest wait for a worker to start or acknowledge weights."
    )
    max_worker_restarts: int = Field(
        3,
        ge=0,
        description="A worker process that dies is replaced (it loads the current weights and is "
        "sent again the prompts it had not returned) up to this many times per worker slot; one "
        "more death stops the run.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where separate workers run: local (spawned processes on this machine, "
        "shared-memory weights) or ray (Ray actors, on this machine or a cluster; needs the "
        "'ray' extra).",
    )
    ray_address: str | None = Field(
        None,
        description="ray: address of a running cluster to join ('auto', or 'HEAD_IP:6379'); "
        "unset: start a Ray on this machine for the run, listening on loopback only.",
    )
    ray_num_cpus: int = Field(
        0, ge=0, description="ray: CPUs the Ray started for the run offers (0: all cores)."
    )
    num_cpus_per_worker: float = Field(
        1.0, ge=0, description="ray: CPUs each worker actor reserves (Ray's num_cpus)."
    )
    num_gpus_per_worker: float = Field(
        0.0,
        ge=0,
        description="ray: GPUs each worker actor reserves (Ray's num_gpus); above 0 the worker "
        "generates on its GPU.",
    )
    ray_worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="ray: custom Ray resources each worker actor reserves besides its CPUs and "
        "GPUs, e.g. { rollout = 1 }: workers then run only on nodes started with that resource "
        "(`ray start --resources='{\"rollout\": 4}'`), and a worker that dies is replaced on "
        "such a node; none left alive stops the run naming the resource. {}: any node with the "
        "CPUs and GPUs.",
    )
    weight_sync: Literal["object_store", "broadcast"] = Field(
        "object_store",
        description="ray: how a new version reaches the workers: object_store (put once into "
        "Ray's object store, every worker reads the same object) or broadcast (torch.distributed "
        "broadcast from the learner: NCCL when model.device is a GPU, gloo otherwise).",
    )

    @model_validator(mode="after")
    def _periodic_needs_workers(self) -> PipelineConfig:
        if self.mode in ("periodic", "offpolicy") and self.placement != "separate":
            raise ValueError(
                f"pipeline.mode = '{self.mode}' needs pipeline.placement = 'separate' "
                "(colocated generation cannot overlap with training)"
            )
        self._partial_rollout_keys()
        if self.queue_size and self.mode != "periodic":
            raise ValueError(
                "pipeline.queue_size bounds how far generation runs ahead of a streaming "
                f"learner: it applies to pipeline.mode = 'periodic' only, not '{self.mode}'"
            )
        if self.backend == "ray" and self.placement != "separate":
            raise ValueError(
                "pipeline.backend = 'ray' runs the inference workers as Ray actors: set "
                "pipeline.placement = 'separate'"
            )
        if self.backend == "local":
            for key in RAY_ONLY:
                default = PipelineConfig.model_fields[key].get_default(call_default_factory=True)
                if getattr(self, key) != default:
                    raise ValueError(
                        f"pipeline.{key} applies to pipeline.backend = 'ray' only: set the "
                        f"backend or leave pipeline.{key} out"
                    )
        check_custom_resources("pipeline.ray_worker_resources", self.ray_worker_resources)
        if self.ray_address and self.ray_num_cpus:
            raise ValueError(
                "pipeline.ray_num_cpus sizes the Ray started for the run; a cluster joined with "
                "pipeline.ray_address has its own: leave pipeline.ray_num_cpus out"
            )
        return self

    def _partial_rollout_keys(self) -> None:
        if self.partial_rollout and self.mode != "offpolicy":
            raise ValueError(
                "pipeline.partial_rollout = true needs pipeline.mode = 'offpolicy' (got "
                f"'{self.mode}'): a sequence that takes new weights mid-way holds tokens of "
                "two versions, which only the off-policy mode trains"
            )
        if self.partial_rollout and self.max_staleness == 0:
            raise ValueError(
                "pipeline.partial_rollout = true needs pipeline.max_staleness >= 1: a sequence "
                "that spans two versions is at least one version stale when trained"
            )
        for key, value in (
            ("partial_rollout_kv", self.partial_rollout_kv != "keep"),
            ("staleness_strategy", self.staleness_strategy != "drop"),
        ):
            if value and not self.partial_rollout:
                raise ValueError(
                    f"pipeline.{key} applies to pipeline.partial_rollout = true only: set it or "
                    f"leave pipeline.{key} out"
                )


RAY_ONLY = (
    "ray_address",
    "ray_num_cpus",
    "num_cpus_per_worker",
    "num_gpus_per_worker",
    "weight_sync",
    "ray_worker_resources",
)

# Ray's own resources, which have keys of their own (num_cpus_per_worker, num_gpus_per_rank...)
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_custom_resources(key: str, resources: dict[str, float]) -> None:
    """Custom Ray resources: a name Ray does not own, an amount above 0."""
    for name, amount in resources.items():
        if name in RAY_BUILTIN_RESOURCES or name.startswith("node:"):
            raise ValueError(
                f"{key}.{name} is a resource Ray defines itself: CPUs and GPUs have keys of their "
                "own (num_cpus_per_*, num_gpus_per_*); name a custom resource of your nodes"
            )
        if not amount > 0:
            raise ValueError(f"{key}.{name} = {amount}: a resource amount must be above 0")


class EnvConfig(_Section):
    kind: Literal["single_turn", "tool", "class", "openenv", "verifiers"] = Field(
        "single_turn",
        description="single_turn: one prompt, one response; tool: multi-turn episodes in which "
        "the policy calls tools with <call>NAME: ARGUMENT</call> and reads <result>...</result> "
        "(src/cadence/envs/syntax.py); a turn without a call is the final answer; class: an "
        "environment class on TRL's environment_factory contract (env.factory or "
        "env.factories), its methods the tools, called and answered in the model's chat "
        "template; openenv: an OpenEnv Environment class run in the rollout worker, no server "
        "(env.factory; the 'openenv' extra). class and openenv need data.chat_template; "
        "verifiers: the episodes of a verifiers environment (env.factory), run by verifiers "
        "against cadence's own endpoint in each rollout worker (the 'verifiers' extra; "
        "docs/envs.md).",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="kind 'tool': the tools the policy may call: 'calculator' (arithmetic, parsed "
        "safely) or 'module:function' (fn(argument: str) -> str, called by its function name).",
    )
    factory: str | None = Field(
        None,
        description="kind 'class': the environment class, 'package.module:Class', made with no "
        "arguments: reset(**row) -> str | None, every other public method a tool (type hints "
        "and an Args: docstring), optional get_reward() -> float (TRL's environment_factory "
        "contract; 'cadence.envs.calculator:Calculator' ships). kind 'openenv': an OpenEnv "
        "Environment class (an MCPEnvironment's tools are called in the chat format; any other "
        "gets the policy's text as its action). kind 'verifiers': 'module:function' returning "
        "the environment (a verifiers.v1.Env, as an environment package's load_environment "
        "does), importable where the workers run; prompts come from its taskset, rewards from "
        "its tasks' rubric.",
    )
    factories: dict[str, str] | None = Field(
        None,
        description="kind 'class', instead of factory: several environment classes by name, "
        "{ name = 'package.module:Class' }; each row picks one by its 'environment' field (a "
        "data set column), as TRL's dict environment_factory does, and its prompt shows that "
        "class's tools only.",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="kinds but single_turn: most policy turns per episode (each a call or the "
        "end).",
    )
    max_total_tokens: int = Field(
        256,
        ge=1,
        description="kinds but single_turn: most tokens per episode after the prompt, policy and "
        "environment replies together (each turn is also capped by rollout.max_new_tokens).",
    )
    tool_timeout_s: float = Field(
        5.0,
        gt=0,
        description="kinds but single_turn: a tool call (an OpenEnv step) still running after "
        "this many seconds is cut off; the policy reads an error (counted as tool_timeouts), "
        "the run goes on.",
    )

    @field_validator("factory")
    @classmethod
    def _module_and_attribute(cls, factory: str | None) -> str | None:
        if factory is not None and not _FACTORY.fullmatch(factory):
            raise ValueError(
                f"{factory!r} is not 'module:name' (a dotted module path, a colon, a name)"
            )
        return factory

    @model_validator(mode="after")
    def _factory_for_verifiers(self) -> EnvConfig:
        if self.kind == "verifiers" and self.factory is None:
            raise ValueError(
                "env.kind = 'verifiers' needs env.factory = 'module:function' returning the "
                "verifiers environment"
            )
        return self

    @model_validator(mode="after")
    def _keys_of_the_kind(self) -> EnvConfig:
        for key, kinds in ENV_KEYS.items():
            default = EnvConfig.model_fields[key].get_default(call_default_factory=True)
            if self.kind not in kinds and getattr(self, key) != default:
                names = [f"'{k}'" for k in kinds]
                allowed = " or ".join([", ".join(names[:-1]), names[-1]] if names[1:] else names)
                raise ValueError(
                    f"env.{key} applies to env.kind = {allowed} only, not '{self.kind}': set "
                    f"the kind or leave env.{key} out"
                )
        if self.kind == "tool" and not self.tools:
            raise ValueError("env.kind = 'tool' needs at least one tool in env.tools")
        if self.kind == "class" and (self.factory is None) == (self.factories is None):
            raise ValueError(
                "env.kind = 'class' needs env.factory = 'package.module:Class', or "
                "env.factories = { name = 'package.module:Class' } for a mix: one of the two"
            )
        if self.kind == "class" and self.factories == {}:
            raise ValueError("env.factories is empty: name at least one environment class")
        if self.kind == "openenv" and not self.factory:
            raise ValueError("env.kind = 'openenv' needs env.factory = 'package.module:Class'")
        return self


EPISODES = ("tool", "class", "openenv")  # the kinds whose samples are multi-turn episodes
ENV_KEYS = {  # key -> the kinds it applies to
    "tools": ("tool",),
    "factory": ("class", "openenv", "verifiers"),
    "factories": ("class",),
    "max_turns": EPISODES,
    "max_total_tokens": EPISODES,
    "tool_timeout_s": EPISODES,
}
_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class SFTConfig(_Section):
    base: str = Field("runs/base", description="Model directory SFT starts from.")
    out: str = Field("runs/sft", description="Where the SFT model is written (cached).")
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per step.")
    lr: float = Field(2e-3, gt=0.0, description="Peak learning rate (cosine decay).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")


class MetricsConfig(_Section):
    tensorboard: bool = Field(False, description="Also write TensorBoard event files.")
    progress: bool = Field(True, description="Live progress display on the console.")
    wandb: bool = Field(
        False,
        description="Log to Weights & Biases (the 'wandb' extra): the figures of metrics.jsonl, "
        "the config, the summary and timeline.png, under OUT/wandb; WANDB_MODE=offline needs no "
        "network, WANDB_PROJECT names the project (default 'cadence').",
    )
    mlflow: bool = Field(
        False,
        description="Log to MLflow (the 'mlflow' extra), the same figures and files: to "
        "MLFLOW_TRACKING_URI if set, else a local file store in ./mlruns; "
        "MLFLOW_EXPERIMENT_NAME names the experiment (default 'cadence').",
    )


class Config(_Section):
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="The policy: a local Hugging Face causal-LM directory, its dtype and device, "
        "and optionally a LoRA adapter (docs/data.md).",
    )
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="Where prompts and reference answers come from: the procedural arithmetic "
        "task, GSM8K-format rows or any local data set; the held-out split; prompt rendering and "
        "chat templates (docs/data.md).",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Sampling: group size, response length, temperature, stop strings, the "
        "engine that generates (continuous, static, vLLM) and its settings (docs/engines.md).",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="Scoring: a rule function or a learned reward model, where it runs (inside "
        "the rollout worker or as a separate stage), its error budget and timeout, and DAPO's "
        "overlong shaping (docs/data.md, docs/pipeline.md).",
    )
    algo: AlgoConfig = Field(
        default_factory=AlgoConfig,
        description="The RL objective: advantage estimator, loss, clipping, KL to the "
        "reference, aggregation, importance-sampling correction, online DPO "
        "(docs/algorithms.md).",
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="The optimisation: iterations, prompts per iteration, AdamW, micro-batches, "
        "held-out evaluation, threads, checkpoints and bad-step tolerance.",
    )
    learner: LearnerConfig = Field(
        default_factory=LearnerConfig,
        description="How the learner computes: shared-prompt packing, old-logprob reuse "
        "(docs/learner.md), and learner ranks with FSDP2 or DDP (docs/ranks.md).",
    )
    pipeline: PipelineConfig = Field(
        default_factory=PipelineConfig,
        description="How generation and training overlap: the mode (sync, periodic, offpolicy), "
        "placement, workers, dynamic sampling, worker recovery, and the Ray backend "
        "(docs/pipeline.md, docs/ray.md).",
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="What a sample is: one response, a multi-turn episode with tools, or an "
        "episode of a verifiers environment (docs/envs.md).",
    )
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="`cadence sft`: the supervised warm start on the task's reference "
        "solutions, cached by its settings.",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="Where figures go besides metrics.jsonl: the console, TensorBoard, "
        "Weights & Biases, MLflow (docs/outputs.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _reasoning_gym_reward(cls, data: Any) -> Any:
        """reasoning-gym rows are scored by their own datasets unless reward.function is set."""
        if not isinstance(data, dict):
            return data
        d = data.get("data")
        if isinstance(d, DataConfig):
            task = d.task
        else:
            task = d.get("task") if isinstance(d, dict) else None
        if task == "reasoning_gym":
            reward = data.setdefault("reward", {})
            if isinstance(reward, dict):
                reward.setdefault("function", "reasoning_gym")
        return data

    @model_validator(mode="after")
    def _reasoning_gym_rows(self) -> Config:
        if self.reward.function == "reasoning_gym" and self.data.task != "reasoning_gym":
            raise ValueError(
                "reward.function = 'reasoning_gym' scores reasoning-gym rows with their own "
                f"metadata: it needs data.task = 'reasoning_gym', not '{self.data.task}'"
            )
        return self

    @model_validator(mode="after")
    def _chat_environments_need_a_chat_template(self) -> Config:
        if self.env.kind in ("class", "openenv") and self.data.chat_template is False:
            raise ValueError(
                f"env.kind = '{self.env.kind}' writes tool calls and replies in the model's chat "
                "template: set data.chat_template = true (the tokenizer's, if it renders tools) "
                "or to a Jinja file that does (configs/chat-tools.jinja)"
            )
        return self

    @model_validator(mode="after")
    def _correction_needs_sampled_logprobs(self) -> Config:
        mode = self.algo.rollout_correction
        if self.rollout.temperature == 0 and (mode != "none" or self.algo.tis_cap > 0):
            raise ValueError(
                f"algo.rollout_correction = '{mode if mode != 'none' else 'token_truncate'}' "
                "weighs by pi_old / pi_behaviour, but with rollout.temperature = 0 the engine "
                "decodes greedily: the log-probs it records are not those of the policy that "
                "chose the tokens (greedy gives each probability 1). Sample (rollout.temperature "
                "> 0) or set algo.rollout_correction = 'none' and algo.tis_cap = 0"
            )
        return self

    @model_validator(mode="after")
    def _reward_stage_needs_workers(self) -> Config:
        if self.reward.stage == "separate" and self.pipeline.placement != "separate":
            raise ValueError(
                "reward.stage = 'separate' (the default for reward.kind = 'model') scores in "
                "reward workers beside the rollout workers: set pipeline.placement = 'separate'"
            )
        return self

    @property
    def max_policy_tokens(self) -> int:
        """The most tokens the policy writes in one episode: the cap of the overlong penalty and
        of seq-sum-norm's constant. Single-turn, rollout.max_new_tokens; with tools, each of at
        most env.max_turns turns writes at most rollout.max_new_tokens, and everything after the
        prompt (tool replies too) fits env.max_total_tokens, so the smaller of the two."""
        r, e = self.rollout, self.env
        if e.kind == "single_turn":
            return r.max_new_tokens
        return min(e.max_turns * r.max_new_tokens, e.max_total_tokens)

    @property
    def response_budget(self) -> tuple[int, str]:
        """(the most tokens after the prompt, the key that sets them): rollout.max_new_tokens, or
        with an environment the whole episode (env.max_total_tokens: turns and tool replies)."""
        if self.env.kind != "single_turn":
            return self.env.max_total_tokens, "env.max_total_tokens"
        return self.rollout.max_new_tokens, "rollout.max_new_tokens"

    @model_validator(mode="after")
    def _prompt_fits_vllm(self) -> Config:
        """rollout.vllm.max_model_len caps prompt and response together: a response budget that
        leaves no prompt room is refused here (the model's own positions once it is read)."""
        r, cap = self.rollout, self.rollout.vllm.max_model_len
        if not cap:
            return self
        reply, what = self.response_budget
        where = f"rollout.vllm.max_model_len = {cap}"
        if cap - reply < 1:
            raise ValueError(f"{what} = {reply} leaves no room for a prompt in {where}: lower it")
        if r.max_prompt_tokens > cap - reply:
            raise ValueError(
                f"rollout.max_prompt_tokens = {r.max_prompt_tokens} plus {what} = {reply} "
                f"exceeds {where}: set rollout.max_prompt_tokens <= {cap - reply}, or 0 for "
                "that limit"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> Config:
        buffer, longest = self.reward.overlong_buffer, self.max_policy_tokens
        if buffer > longest:
            what = "rollout.max_new_tokens"
            if self.env.kind != "single_turn":
                what = "the episode's cap (env.max_turns x rollout.max_new_tokens, at most "
                what += "env.max_total_tokens)"
            raise ValueError(
                f"reward.overlong_buffer = {buffer} is longer than {what} = {longest}: the "
                "penalty ramps over the last policy tokens before that cap; set "
                f"reward.overlong_buffer <= {longest}"
            )
        return self

    @model_validator(mode="after")
    def _learner_ranks(self) -> Config:
        ranks, backend = self.learner, self.pipeline.backend
        if backend != "ray":
            for key in ("num_cpus_per_rank", "num_gpus_per_rank", "ray_rank_resources"):
                default = LearnerConfig.model_fields[key].get_default(call_default_factory=True)
                if getattr(ranks, key) != default:
                    raise ValueError(
                        f"learner.{key} applies to pipeline.backend = 'ray' only: set the "
                        f"backend or leave learner.{key} out"
                    )
        check_custom_resources("learner.ray_rank_resources", ranks.ray_rank_resources)
        on_gpu = self.model.device.startswith("cuda")
        if ranks.ranks > 1 and backend == "ray" and on_gpu and ranks.num_gpus_per_rank == 0:
            raise ValueError(
                f"learner.ranks = {ranks.ranks} on Ray with model.device = "
                f"'{self.model.device}': set learner.num_gpus_per_rank > 0 (each rank "
                "trains on a GPU of its own)"
            )
        if ranks.ranks > 1 and self.model.lora is not None:
            raise ValueError(
                f"learner.ranks = {ranks.ranks} with model.lora: the ranks shard a full model; "
                "train a LoRA adapter with learner.ranks = 1"
            )
        return self

    @model_validator(mode="after")
    def _verifiers_env(self) -> Config:
        """A verifiers environment brings its tasks, prompts and rewards: the keys that would
        choose them otherwise are refused rather than ignored."""
        if self.env.kind != "verifiers":
            return self
        if self.data.task != DataConfig.model_fields["task"].default:
            raise ValueError(
                "env.kind = 'verifiers' takes its tasks from the environment's taskset: leave "
                "data.task out"
            )
        if isinstance(self.data.chat_template, str):
            raise ValueError(
                "env.kind = 'verifiers': data.chat_template = true renders with the model's own "
                "template (verifiers' renderer for it), false with cadence's plain renderer; a "
                "template file is not supported"
            )
        if self.reward.stage == "separate":
            raise ValueError(
                "env.kind = 'verifiers' scores each episode with the environment's rubric in "
                "the rollout worker: set reward.stage = 'worker'"
            )
        return self

    @model_validator(mode="after")
    def _partial_rollout_engine(self) -> Config:
        """Partial rollouts need an engine that takes weights between decode steps and stamps
        each token's version, and responses of one turn."""
        if not self.pipeline.partial_rollout:
            return self
        engine = self.rollout.engine
        if engine == "vllm" and self.pipeline.partial_rollout_kv == "recompute":
            raise ValueError(
                "pipeline.partial_rollout_kv = 'recompute' with rollout.engine = 'vllm': the "
                "vLLM engine keeps the keys and values of requests in flight; use "
                "partial_rollout_kv = 'keep', or rollout.engine = 'continuous' to recompute"
            )
        if engine == "static":
            raise ValueError(
                "pipeline.partial_rollout = true with rollout.engine = 'static': static batches "
                "decode a whole batch in one call, with no step between tokens to load weights "
                "at; use rollout.engine = 'continuous' (or 'vllm')"
            )
        if self.env.kind != "single_turn":
            raise ValueError(
                f"pipeline.partial_rollout = true with env.kind = '{self.env.kind}': partial "
                "rollouts load weights between decode steps of single responses, not inside "
                "multi-turn episodes; use env.kind = 'single_turn' or turn partial_rollout off"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_devices(self) -> Config:
        p = self.pipeline
        on_gpu = self.model.device.startswith("cuda")
        if p.weight_sync == "broadcast" and on_gpu and p.num_gpus_per_worker == 0:
            raise ValueError(
                f"pipeline.weight_sync = 'broadcast' with model.device = '{self.model.device}' "
                "broadcasts over NCCL, GPU to GPU: set pipeline.num_gpus_per_worker > 0 or use "
                "pipeline.weight_sync = 'object_store'"
            )
        return self


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"config key '{key}': {msg}")
    return "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """A TOML literal (number, bool, quoted string, list) or else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{p}' is not a section")
        node[leaf] = _parse_value(raw.strip())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from e
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to every run directory)."""
    out: list[str] = []
    for section, values in cfg.model_dump(exclude_none=True).items():
        _toml_table(section, values, out)
    return "\n".join(out)


def _toml_table(name: str, values: dict[str, Any], out: list[str]) -> None:
    """`[name]` with its plain keys, then each nested table as `[name.key]`."""
    out.append(f"[{name}]")
    plain = (k for k, v in values.items() if not isinstance(v, dict))
    out.extend(f"{_toml_key(k)} = {_toml_value(values[k])}" for k in plain)
    out.append("")
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_table(f"{name}.{_toml_key(k)}", v, out)


def _toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (a Ray resource such as
    'accelerator_type:A100')."""
    if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key):
        return key
    import json

    return json.dumps(key)


def _toml_value(v: Any) -> str:
    if isinstance(v, dict):  # a sub-table (model.lora), inline
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    import json

    return json.dumps(str(v))  # a JSON string is a valid TOML basic string
