"""`[data]`: where prompts and reference answers come from (tasks, local data sets, reasoning-gym
mixes), held-out splits and prompt rendering."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from cadence.config.base import Section, changed


class ReasoningGymDataset(Section):
    weight: float = Field(1.0, gt=0.0)
    """This dataset's share of the mix: each row picks a dataset with probability weight / (sum of
    the weights), as reasoning-gym's DatasetSpec weights do."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset's own config class in reasoning-gym (for chain_sum:
    min_terms, max_terms, min_digits, max_digits, allow_negation); a key the dataset does not
    have is an error when the task is built. Not seed or size: data.reasoning_gym sets them for
    every dataset."""

    @model_validator(mode="after")
    def _no_seed_or_size(self) -> ReasoningGymDataset:
        for key in ("seed", "size"):
            if key in self.config:
                raise ValueError(
                    f"config.{key} is set by data.reasoning_gym.{key} for every dataset (a "
                    "dataset's own seed would hold out rows that training draws too): leave it out"
                )
        return self


class ReasoningGymConfig(Section):
    datasets: dict[str, ReasoningGymDataset] = Field(..., min_length=1)
    """The mix: reasoning-gym dataset name -> { weight = 1.0, config = { ... } } (reasoning-gym's
    own `datasets` table, as its TRL and verl examples write it). Each row's reward is its
    dataset's own score_answer (reward.function 'reasoning_gym')."""
    size: int = Field(1000, ge=1)
    """Training rows drawn from the mix (reasoning-gym's dataset_size); each epoch visits every one
    once, in an order shuffled by the seed. Rows whose question is held out are dropped."""
    seed: int | None = None
    """Seed of the training rows and their order (default: train.seed). The held-out rows are drawn
    with a seed hashed from data.seed, so they never coincide with training rows."""
    developer_prompt: str | None = None
    """The system message of every prompt: a name of reasoning-gym's SYSTEM_PROMPTS ('DeepSeekZero',
    'default', 'simple', 'direct', 'chain_of_draft': they ask for the answer in <answer> tags) or
    the text itself. Needs data.chat_template; instead of data.system_prompt."""


class DataConfig(Section):
    task: Literal["arithmetic", "gsm8k", "dataset", "reasoning_gym"] = "arithmetic"
    """Task family: procedural arithmetic; gsm8k (GSM8K-format rows: question, answer ending in
    '#### x'); dataset (any local data set, columns named by prompt_field and answer_field);
    reasoning_gym (a weighted mix of reasoning-gym's procedural datasets, [data.reasoning_gym];
    needs the 'reasoning-gym' extra)."""
    reasoning_gym: ReasoningGymConfig | None = None
    """Task 'reasoning_gym': the table { datasets = { name = { weight, config } }, size, seed,
    developer_prompt }."""
    path: str | None = None
    """'gsm8k' and 'dataset': a local JSONL, JSON, parquet or CSV file, a save_to_disk directory, or
    a folder of data files named by split (train-*.parquet, test.jsonl, as a hub download leaves
    them). Never a hub id: download first."""
    heldout_path: str | None = None
    """Held-out data for 'gsm8k' and 'dataset' (any form `path` takes); default: heldout_split,
    heldout_fraction, or else the last num_heldout rows."""
    split: str = "train"
    """'gsm8k' and 'dataset': the split trained on."""
    heldout_split: str | None = None
    """The held-out split of `path` (or of heldout_path), e.g. 'test'."""
    heldout_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Without a held-out split or path: hold out this fraction of the rows (a seeded draw; 0: the
    last num_heldout rows)."""
    prompt_field: str = "question"
    """'dataset': the column holding the prompt: a string, or a conversation (a list of {role,
    content} messages in OpenAI format, ending with the user's turn; needs chat_template)."""
    answer_field: str = "answer"
    """'dataset': the column holding the reference (a number, an expression, or a worked solution
    whose final answer reward.answer_format extracts)."""
    chat_template: bool | str = False
    """true: render every prompt with the tokenizer's chat template (system_prompt, then the user's
    message, then the assistant's turn begins); a path: a Jinja template file to use instead of the
    tokenizer's; false: prompt_template as plain text. With env.kind 'verifiers': true renders every
    turn with verifiers' renderer for the model, false with cadence's plain one (texts concatenated,
    <call> syntax for tools)."""
    system_prompt: str | None = None
    """chat_template: a system message put before every prompt's messages."""
    difficulty: int = Field(1, ge=1, le=3)
    """Arithmetic difficulty, 1 (easiest)-3."""
    max_operand: int | None = Field(None, ge=2)
    """Largest arithmetic operand (default: the difficulty's range)."""
    num_heldout: int = Field(200, ge=1)
    """Held-out examples for accuracy (at most)."""
    seed: int = 0
    """Seed of the held-out split (task 'arithmetic' or 'reasoning_gym', or a data set's
    heldout_fraction): fixed whatever train.seed, so runs with different seeds are measured on the
    same problems."""
    prompt_template: str = "Question: {question}\nAnswer: "
    """Prompt text; {question} is replaced. With chat_template, the user's message (default there:
    '{question}')."""
    on_bad_line: Literal["error", "skip"] = "error"
    """Malformed row or line: stop with file:line, or skip and count."""

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
        for key in changed(self, refused[self.task]):
            tasks = "'dataset'" if key in DATASET_ONLY else "'dataset' and 'gsm8k'"
            raise ValueError(
                f"data.{key} applies to data.task = {tasks} only, not '{self.task}': leave it out"
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
        for key in changed(self, NOT_REASONING_GYM):
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
