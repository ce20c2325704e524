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
