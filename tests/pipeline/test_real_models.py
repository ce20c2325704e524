"""Real models and data, end to end on tiny stand-ins: the example configs run one iteration on a
random-init Qwen2 and rows of their data sets' schema; LoRA trains in every mode and resumes
exactly; trackers and bad input in the new keys reach the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cadence.cli import main
from cadence.data import ArithmeticTask
from cadence.models import load_model, save_pretrained
from cadence.models.presets import train_tokenizer
from runs import UNFILTERED
from tiny_models import tiny_causal_lm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A random-init Qwen2 (the Qwen2.5 architecture) with a tokenizer that has a chat template."""
    out = tmp_path_factory.mktemp("qwen") / "tiny-qwen2"
    tokenizer = train_tokenizer([*ArithmeticTask().corpus(500), r"\boxed{\frac{1}{2}}"])
    model = tiny_causal_lm(
        "qwen2",
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        max_positions=1024,  # the configs' rollout.max_prompt_tokens = 512 must fit
    )
    return save_pretrained(model, tokenizer, out)


def _split_folder(root, rows_by_split):
    """A hub download's layout: one parquet file per split."""
    import datasets

    root.mkdir(parents=True)
    for split, rows in rows_by_split.items():
        datasets.Dataset.from_list(rows).to_parquet(str(root / f"{split}-00000-of-00001.parquet"))
    return root


def _run(config, out, *sets):
    common = [
        "train.iterations=1",
        "train.prompts_per_iteration=2",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "data.num_heldout=2",
        "model.device='cpu'",
        "metrics.progress=false",
        # the configs generate with vLLM on a GPU; the tiny model's heads (16 wide) are below
        # what vLLM's CPU attention takes: cadence's own engine here
        "rollout.engine='continuous'",
        "rollout.vllm.gpu_memory_utilization=0.9",
    ]
    args = ["train", str(config), "--out", str(out)]
    for s in [*common, *sets]:
        args += ["--set", s]
    return main(args)


def test_gsm8k_qwen_config_runs_one_iteration(qwen_dir, tmp_path) -> None:
    rows = [
        {"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
        for i in range(6)
    ]
    data = _split_folder(tmp_path / "gsm8k" / "main", {"train": rows, "test": rows[:2]})
    out = tmp_path / "run"
    assert (
        _run("configs/gsm8k-qwen.toml", out, f"model.path='{qwen_dir}'", f"data.path='{data}'") == 0
    )
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert line["iteration"] == 0 and line["num_tokens"] > 0
    assert (out / "final" / "model.safetensors").is_file()


def test_math_qwen_config_runs_one_iteration_with_lora(qwen_dir, tmp_path) -> None:
    rows = [
        {
            "problem": f"Compute ${i}/2$.",
            "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$.",
            "level": "Level 1",
        }
        for i in range(6)
    ]
    data = _split_folder(tmp_path / "math" / "data", {"train": rows, "test": rows[:2]})
    out = tmp_path / "run"
    assert (
        _run("configs/math-qwen.toml", out, f"model.path='{qwen_dir}'", f"data.path='{data}'") == 0
    )
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / "final" / "merged" / "model.safetensors").is_file()
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert line["frozen_copies_mb"] == 0.0  # the reference is the base with the adapter off
    assert main(["eval", str(out / "final"), "--config", str(out / "config.toml")]) == 0


LORA = [
    "model.lora.r=4",
    "model.lora.alpha=8.0",
    "model.lora.target_modules=['q_proj', 'v_proj']",
    "algo.kl_coef=0.05",
    "train.lr=5e-2",
    "rollout.group_size=4",
    "train.prompts_per_iteration=4",
    "reward.function='fixtures_rewards:even_length'",
]
MODES = {
    "sync-colocated": [],
    "periodic": [
        "pipeline.mode='periodic'",
        "pipeline.placement='separate'",
        "pipeline.num_workers=1",
        "pipeline.learner_threads=1",
    ],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_lora_run_trains_only_the_adapter_in_every_mode(model_dir, tmp_path, mode) -> None:
    out = tmp_path / "run"
    sets = [f"model.path='{model_dir}'", "train.iterations=2", *LORA, *MODES[mode]]
    assert _run("configs/default.toml", out, *sets) == 0
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k) > 0  # trained
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["frozen_copies_mb"] for r in lines] == [0.0, 0.0]
    assert lines[1]["kl"] > 0  # the policy moved away from the base (the adapter off)
    base, trained = load_model(model_dir), load_model(out / "final")  # merged on loading
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert (base(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max() > 1e-4


def test_a_lora_run_resumes_exactly(model_dir, tmp_path) -> None:
    sets = [f"model.path='{model_dir}'", *LORA, "train.checkpoint_every=1", "train.threads=1"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert _run("configs/default.toml", full, *sets, "train.iterations=3") == 0
    assert _run("configs/default.toml", split, *sets, "train.iterations=2") == 0
    resume = ["train", "--resume", str(split), "--set", "train.iterations=3"]
    assert main(resume) == 0
    a = load_file(full / "final" / "adapter_model.safetensors")
    b = load_file(split / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    lines = (split / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2]


def test_trackers_log_a_whole_run(model_dir, tmp_path, monkeypatch) -> None:
    import mlflow

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    sets = [
        f"model.path='{model_dir}'",
        "train.iterations=2",
        "metrics.wandb=true",
        "metrics.mlflow=true",
        UNFILTERED,  # 8 prompts an iteration, not up to 136: 15 s -> 8 s
    ]
    assert _run("configs/default.toml", out, *sets) == 0
    client = mlflow.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("cadence").experiment_id])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [
        (r["iteration"], r["reward_mean"]) for r in lines
    ]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "timeline.png",
        "summary.json",
    }
    assert list((out / "wandb").glob("offline-run-*/files/summary.json"))


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["data.task='dataset'", "data.path='{data}'", "data.prompt_field='problem'"],
            "'problem' is not a column",
        ),
        (
            ["data.task='dataset'", "data.path='{data}'", "data.answer_field='meta'"],
            "non-string 'meta'",
        ),
        (["data.task='dataset'", "data.path='openai/gsm8k'"], "download it first"),
        (["data.chat_template='{bad}'"], "the chat template failed"),
        (
            ["data.task='dataset'", "data.path='{data}'", "data.prompt_field='chat'"],
            "conversations",
        ),
        (["model.lora.target_modules=['nope']"], "do not fit this model"),
        (["reward.answer_format='box'"], "reward.answer_format"),
        (["model.lora.r=0"], "model.lora.r"),
    ],
)
def test_bad_input_in_the_new_keys_exits_2(model_dir, tmp_path, capsys, sets, message) -> None:
    data = tmp_path / "rows.jsonl"
    rows = [
        {
            "question": f"q{i}",
            "answer": "#### 1",
            "meta": {"a": 1},
            "chat": [{"role": "user", "content": f"q{i}"}],
        }
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # the loop never ends
    sets = [s.replace("{data}", str(data)).replace("{bad}", str(bad)) for s in sets]
    assert _run("configs/default.toml", tmp_path / "run", f"model.path='{model_dir}'", *sets) == 2
    assert message in capsys.readouterr().err
