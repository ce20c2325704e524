import json

import pytest
import torch

from cadence.models import ModelLoadError, load_model, load_tokenizer


def test_default_model_loads_with_the_auto_classes(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert (model_dir / "model.safetensors").is_file()
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"
    ids = tok("Tom has 123 apples.\n#### 5")["input_ids"]
    assert tok.decode(ids) == "Tom has 123 apples.\n#### 5"
    # digits are single tokens: the three digits of 123 decode one by one
    assert [tok.decode([i]) for i in tok("123")["input_ids"]] == ["1", "2", "3"]
    assert ids == load_tokenizer(model_dir)("Tom has 123 apples.\n#### 5")["input_ids"]
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape[-1] == len(tok)


def test_missing_directory_and_non_causal_lm_are_clear_errors(tmp_path, model_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path / "empty")
    from transformers import T5Config

    T5Config(vocab_size=10, d_model=8, d_ff=8, num_layers=1, num_heads=2).save_pretrained(
        tmp_path / "t5"
    )
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(tmp_path / "t5")
