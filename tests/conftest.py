"""Shared fixtures: one tiny model directory per test session, built like the embedded default."""

from __future__ import annotations

import pytest
import torch

from cadence.data import ArithmeticTask
from cadence.models import init_model, load_model, load_tokenizer


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A random-init 'test'-preset Llama with a BPE tokenizer trained on the arithmetic task."""
    out = tmp_path_factory.mktemp("models") / "test-model"
    init_model("test", out, ArithmeticTask(difficulty=1, seed=0).corpus(2000), seed=0)
    return out


@pytest.fixture
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="session")
def calculator_model_dir(tmp_path_factory):
    """The 'test' preset warm-started for 60 steps of 16 calculator demonstrations: it writes
    `<call>calculator: ...</call>` turns often enough that episodes run several turns."""
    from itertools import islice

    from cadence.envs import demonstration
    from cadence.learner.sft import run_sft

    root = tmp_path_factory.mktemp("calculator")
    task = ArithmeticTask(difficulty=1, seed=0)
    corpus = task.corpus(1000) + [
        "".join(t for t, _ in demonstration(e.answer)) for e in islice(task.train_iter(), 1000)
    ]
    init_model("test", root / "base", corpus, seed=0)
    run_sft(
        task,
        "Question: {question}\nAnswer: ",
        root / "base",
        root / "sft",
        steps=60,
        batch_size=16,
        lr=1e-2,
        warmup_steps=5,
        key="test",
        progress=False,
        segments=lambda example: demonstration(example.answer),
    )
    return root / "sft"
