import json

import pytest
import torch

from cadence.models import ModelLoadError, load_model, load_tokenizer
from tiny_models import classifier_dir


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


@pytest.mark.parametrize(
    "arch, name",
    [("llama", "LlamaForSequenceClassification"), ("bert", "BertForSequenceClassification")],
)
def test_a_sequence_classifier_is_refused_instead_of_loaded_with_a_random_head(
    model_dir, tmp_path, arch, name
):
    # Before: the Llama classifier loaded as LlamaForCausalLM with a random lm_head and trained;
    # the BERT one ended in an AttributeError traceback.
    path = classifier_dir(model_dir, tmp_path / arch, arch)
    with pytest.raises(ModelLoadError, match=rf"holds a {name} .*not a causal language model"):
        load_model(path)


def test_a_directory_lacking_a_weight_of_the_causal_lm_is_refused(model_dir, tmp_path):
    path = classifier_dir(model_dir, tmp_path / "classifier", "llama")
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]  # nothing names the class: only the weights tell
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"lacks 1 weight\(s\) .*lm_head\.weight"):
        load_model(path)


def test_a_model_that_needs_its_own_code_is_refused_without_asking(model_dir, tmp_path):
    import shutil

    path = tmp_path / "custom"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "mystery"
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mystery.MysteryForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "modeling_mystery.py").write_text("raise SystemExit('the directory ran its code')\n")
    # transformers asks on stdin when trust_remote_code is left unset; this must not wait
    with pytest.raises(ModelLoadError, match="never runs code from a model directory"):
        load_model(path)


def test_truncated_weights_are_a_clear_error(model_dir, tmp_path):
    import shutil

    path = tmp_path / "truncated"
    shutil.copytree(model_dir, path)
    weights = path / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=r"cannot load weights from .*truncated"):
        load_model(path)
