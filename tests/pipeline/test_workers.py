"""The builder's rollout side: where responses stop, for a model whose end of turn is not EOS."""

import json
import shutil

import pytest

from cadence.builder import open_rollout_engine, rollout_worker, sampling_params
from cadence.config import ConfigError, load_config
from cadence.models import generation_eos_ids, load_tokenizer
from cadence.serve.app import build_server
from cadence.types import Prompt

PROMPTS = [Prompt(f"p{i}", f"Question: What is {i} + 4?\nAnswer: ", "7", i) for i in range(2)]


def _cfg(model_dir, *extra):
    sets = [f"model.path='{model_dir}'", "rollout.max_new_tokens=24", "rollout.group_size=2"]
    return load_config(None, [*sets, *extra])


def _completions(cfg, tokenizer):
    engine, _ = open_rollout_engine(cfg, tokenizer)
    worker = rollout_worker(cfg, engine, tokenizer, score=False)
    return [c for g in worker.rollout(PROMPTS, 0, 0) for c in g.completions]


def _chat_model(model_dir, out, eos_token_id):
    """`model_dir` again, its generation config ending generation at `eos_token_id`."""
    shutil.copytree(model_dir, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": eos_token_id}))
    return out


def test_generation_stops_at_the_models_end_of_turn_token_as_well_as_eos(model_dir, tmp_path):
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    free = _completions(_cfg(model_dir), tokenizer)
    long = next(c for c in free if eos not in c.token_ids[:5])
    end_of_turn = long.token_ids[3]  # what this chat model ends a turn with, say
    chat = _chat_model(model_dir, tmp_path / "chat", [end_of_turn, eos])  # as Gemma lists it
    cfg = _cfg(chat)
    assert sampling_params(cfg, tokenizer).stop_token_ids == (eos, end_of_turn)
    stopped = _completions(cfg, tokenizer)
    for before, after in zip(free, stopped, strict=True):
        if end_of_turn in before.token_ids:
            cut = before.token_ids.index(end_of_turn) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "eos"
        else:
            assert after.token_ids == before.token_ids
    assert len(stopped[free.index(long)].token_ids) <= 4  # it went on past that token before
    server = build_server(str(chat), max_num_seqs=2)  # `cadence serve` stops there too
    try:
        assert server.params.stop_token_ids == (eos, end_of_turn)
    finally:
        server.loop.close()


def test_stop_ids_come_from_the_generation_config_the_model_config_and_the_run(model_dir, tmp_path):
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    single = _chat_model(model_dir, tmp_path / "one", 7)  # an int, not a list
    assert generation_eos_ids(single) == (7,)
    (single / "generation_config.json").unlink()  # then config.json's
    assert generation_eos_ids(single) == (eos,)
    cfg = _cfg(single, "rollout.stop_token_ids=[9, 7]")
    assert sampling_params(cfg, tokenizer).stop_token_ids == (eos, 9, 7)
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids: \[100000\] are not ids"):
        sampling_params(_cfg(single, "rollout.stop_token_ids=[100000]"), tokenizer)
