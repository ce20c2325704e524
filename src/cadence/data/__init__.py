"""Tasks and datasets: where prompts and their reference answers come from.

Nothing here imports torch or touches the network; files are read from local paths only.
"""

from cadence.data.base import DataError
from cadence.data.chat import ChatRender, PlainRender, Render, as_render
from cadence.data.dataset import DatasetTask, read_rows, to_examples
from cadence.data.gsm8k import JsonlTask, load_gsm8k_jsonl
from cadence.data.reasoning_gym import DatasetChoice, ReasoningGymTask
from cadence.data.tasks import (
    DEFAULT_TEMPLATE,
    TASKS,
    ArithmeticTask,
    Example,
    Task,
    load_task,
    make_prompt,
    reference_answer,
    to_prompt,
)

__all__ = [
    "DEFAULT_TEMPLATE",
    "TASKS",
    "ArithmeticTask",
    "ChatRender",
    "DataError",
    "DatasetChoice",
    "DatasetTask",
    "Example",
    "JsonlTask",
    "PlainRender",
    "ReasoningGymTask",
    "Render",
    "Task",
    "as_render",
    "load_gsm8k_jsonl",
    "load_task",
    "make_prompt",
    "read_rows",
    "reference_answer",
    "to_examples",
    "to_prompt",
]
