import pytest

from cadence.cli import main
from cadence.data import ArithmeticTask, make_prompt
from cadence.envs import demonstration
from cadence.learner.sft import encode_batch


def test_sft_loss_covers_answer_and_eos_only(tokenizer):
    ex = ArithmeticTask(seed=0).train_examples(1)[0]
    ids, attn, labels = encode_batch([ex], tokenizer, "Question: {question}\nAnswer: ")
    prompt = tokenizer(make_prompt(ex.question), add_special_tokens=False)["input_ids"]
    answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
    assert ids[0].tolist() == prompt + answer + [tokenizer.eos_token_id]
    assert (labels[0, : len(prompt)] == -100).all()
    assert labels[0, len(prompt) :].tolist() == [*answer, tokenizer.eos_token_id]
    assert attn.sum().item() == ids.shape[1]


def test_a_demonstration_trains_the_policys_pieces_only(tokenizer):
    # the calls and the final answer carry a loss; the tool's results do not, and every piece
    # is tokenised on its own, as a rollout worker appends them
    ex = ArithmeticTask(seed=0).train_examples(1)[0]
    segments = demonstration(ex.answer)
    ids, _, labels = encode_batch(
        [ex], tokenizer, "Question: {question}\nAnswer: ", demonstration_of
    )
    prompt = tokenizer(make_prompt(ex.question), add_special_tokens=False)["input_ids"]
    pieces = [(tokenizer(t, add_special_tokens=False)["input_ids"], keep) for t, keep in segments]
    assert ids[0].tolist() == prompt + [t for p, _ in pieces for t in p] + [tokenizer.eos_token_id]
    want = [t if keep else -100 for p, keep in pieces for t in p] + [tokenizer.eos_token_id]
    assert labels[0, len(prompt) :].tolist() == want
    assert [keep for _, keep in segments] == [True, False, True] and -100 in want


def demonstration_of(example):
    return demonstration(example.answer)


@pytest.mark.slow
def test_sft_command_trains_then_is_cached(model_dir, tmp_path, capsys):
    out = tmp_path / "sft"
    args = [
        "sft",
        "configs/default.toml",
        "--set",
        f"sft.base='{model_dir}'",
        "--set",
        f"sft.out='{out}'",
        "--set",
        "sft.steps=3",
        "--set",
        "sft.batch_size=4",
        "--set",
        "metrics.progress=false",
    ]
    assert main(args) == 0
    assert (out / "model.safetensors").is_file() and (out / "sft.json").is_file()
    assert "SFT done: 3 steps" in capsys.readouterr().out
    assert main(args) == 0
    assert "cached" in capsys.readouterr().out
    assert main([*args, "--set", "sft.steps=4"]) == 0  # other settings: trained again
    assert "SFT done: 4 steps" in capsys.readouterr().out
