"""`cadence init-model --from-gguf`: a GGUF file becomes a Hugging Face directory right for RL.

Most tests run on a tiny llama written here with the `gguf` package's writer (2 layers, a byte-level
vocabulary of 262 tokens, two feed-forward weights in Q8_0), in well under a second each; the
`slow` ones at the end check the real SmolLM2-135M-Instruct file that `make smollm2` installs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cadence.cli import main
from cadence.models import load_model, load_tokenizer
from cadence.models.gguf import ConversionError, convert_gguf, read_gguf_info

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order (what byte-level BPE vocabularies spell)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    eos: int = 2,
    eot: int | None = None,
    pre: str = "smollm",
    seed: int = 0,
) -> Path:
    """A tiny llama in GGUF: SmolLM2's special tokens, a merge '1 2' (which SmolLM's digit split
    must never apply), tied embeddings, no pad token."""
    import gguf

    merges = ["1 2", "h i", "Ġ h"]
    tokens = SPECIALS + _byte_alphabet() + [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(SPECIALS)
    )
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, array, quantized in _tensors(len(tokens), seed):
        if quantized:
            w.add_tensor(
                name,
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensors(vocab: int, seed: int):
    """(GGUF name, float32 array in (out, in) layout, stored as Q8_0?) of every weight."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    kv = KV_HEADS * HIDDEN // HEADS
    yield "token_embd.weight", rand(vocab, HIDDEN), False
    yield "output_norm.weight", 1 + rand(HIDDEN), False
    for i in range(LAYERS):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", 1 + rand(HIDDEN), False
        yield b + "attn_q.weight", rand(HIDDEN, HIDDEN), False
        yield b + "attn_k.weight", rand(kv, HIDDEN), False
        yield b + "attn_v.weight", rand(kv, HIDDEN), False
        yield b + "attn_output.weight", rand(HIDDEN, HIDDEN), False
        yield b + "ffn_norm.weight", 1 + rand(HIDDEN), False
        yield b + "ffn_gate.weight", rand(FFN, HIDDEN), i == 0  # Q8_0: 32-value blocks per row
        yield b + "ffn_up.weight", rand(FFN, HIDDEN), i == 0
        yield b + "ffn_down.weight", rand(HIDDEN, FFN), False


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("converted") / "tiny")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --- the round trip on the tiny file ---------------------------------------------------------


def test_converted_directory_loads_with_cadence_loaders_in_float32(converted):
    assert {p.name for p in converted.out.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    model = load_model(converted.out)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == converted.num_parameters
    assert "quantization_config" not in json.loads((converted.out / "config.json").read_text())
    assert len(load_tokenizer(converted.out)) == converted.vocab_size == 262


def test_weights_equal_the_file_and_transformers_own_gguf_load(tiny_gguf, converted):
    import gguf
    from transformers import AutoModelForCausalLM, GgufConfig

    model = load_model(converted.out)
    written = {name: array for name, array, _ in _tensors(262, seed=0)}
    # stored as float32 in the file: equal bit for bit
    assert torch.equal(
        model.model.embed_tokens.weight, torch.from_numpy(written["token_embd.weight"])
    )
    # Q8_0 in the file: dequantised as the gguf package defines it, and close to what was written
    q8 = gguf.GGMLQuantizationType.Q8_0
    w = written["blk.0.ffn_gate.weight"]
    want = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8))
    gate = model.model.layers[0].mlp.gate_proj.weight
    assert torch.equal(gate, want)
    assert (gate - torch.from_numpy(w)).abs().max() < 0.01 * np.abs(w).max()
    direct = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent,
        gguf_file=tiny_gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    ids = torch.randint(3, 262, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)


def test_tokenizer_has_eos_pad_template_and_splits_digits_as_llama_cpp(tiny_gguf, converted):
    tok = load_tokenizer(converted.out)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == 2  # the file names no pad token: EOS stands in, saved as such
    assert json.loads((converted.out / "tokenizer_config.json").read_text())["pad_token"] == (
        "<|im_end|>"
    )
    assert tok.model_max_length == 128
    # the file's merge '1 2' exists, but SmolLM's pre-tokenizer splits every digit first
    assert tok.convert_ids_to_tokens(tok("x 12").input_ids) == ["x", "Ġ", "1", "2"]
    assert tok.convert_ids_to_tokens(tok(" hi").input_ids) == ["Ġ", "hi"]  # merges by rank
    assert (converted.out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    gen = json.loads((converted.out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"], gen["bos_token_id"]) == (2, 2, 1)
    assert converted.stop_token_ids == (2,)


def test_other_pre_tokenizers_keep_transformers_split(tmp_path):
    """The digit split is llama.cpp's for SmolLM's family only: a 'gpt2' file keeps the merge."""
    out = convert_gguf(write_tiny_gguf(tmp_path / "g.gguf", pre="gpt2"), tmp_path / "out").out
    tok = load_tokenizer(out)
    assert tok.convert_ids_to_tokens(tok("x12").input_ids) == ["x", "12"]


def test_end_of_turn_token_becomes_eos_and_both_stop_generation(tmp_path):
    """A file whose EOS ends the document (<|endoftext|>) and whose eot ends the turn: replies must
    stop at the turn, so the tokenizer's EOS (where cadence stops) is the end-of-turn token."""
    path = write_tiny_gguf(tmp_path / "eot.gguf", eos=0, eot=2)
    r = convert_gguf(path, tmp_path / "out")
    tok = load_tokenizer(r.out)
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((r.out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0] == list(r.stop_token_ids)
    assert json.loads((r.out / "config.json").read_text())["eos_token_id"] == 2


def test_files_are_readable_by_others_like_any_saved_model(converted):
    """mkdtemp makes 0700 and safetensors writes 0600; the directory gets the umask's modes."""
    assert converted.out.stat().st_mode & 0o755 == 0o755
    assert all(p.stat().st_mode & 0o644 == 0o644 for p in converted.out.iterdir())


# --- refusals: exit 2 with the reason ----------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["init-model", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_missing_file_exits_2_naming_it(tmp_path, capsys):
    code, text = _cli(capsys, "--from-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path))
    assert code == 2
    assert "nope.gguf' does not exist" in text


def test_file_that_is_not_gguf_exits_2(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_text("not a model\n")
    code, text = _cli(capsys, "--from-gguf", str(path), "--out", str(tmp_path / "out"))
    assert code == 2
    assert "is not a GGUF file: it starts with b'not '" in text
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_is_refused(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"cannot read GGUF file .*cut\.gguf"):
        read_gguf_info(cut)


def _t5_gguf(path: Path) -> Path:
    """A GGUF file of a T5 (an encoder-decoder, not a causal LM): metadata and one tensor."""
    import gguf

    w = gguf.GGUFWriter(path, "t5")
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "</s>", "<unk>", "a"])
    w.add_token_scores([0.0] * 4)
    w.add_token_types([3, 3, 2, 1])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("arch", "reason"),
    [
        ("rwkv6", "GGUF model with architecture rwkv6 is not supported"),
        ("t5", "Unrecognized configuration class"),
    ],
)
def test_architecture_transformers_cannot_load_as_causal_lm_exits_2_naming_it(
    arch, reason, tmp_path, capsys
):
    path = tmp_path / f"{arch}.gguf"
    if arch == "t5":
        _t5_gguf(path)
    else:
        write_tiny_gguf(path, arch=arch)
    code, text = _cli(capsys, "--from-gguf", str(path), "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"transformers cannot load '{path}' as a causal LM ('{arch}' architecture)" in text
    assert reason in text and len(text) < 600  # the reason, not transformers' list of classes
    assert list(tmp_path.iterdir()) == [path]  # nothing written, no temporary directory left


def test_preset_options_with_gguf_are_refused(tiny_gguf, tmp_path, capsys):
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as e:  # argparse: mutually exclusive
        main(["init-model", "--preset", "test", "--from-gguf", str(tiny_gguf), "--out", out])
    assert e.value.code == 2
    code, text = _cli(capsys, "--from-gguf", str(tiny_gguf), "--out", out, "--config", "c.toml")
    assert code == 2 and "--config and --set apply to --preset" in text
    assert not (tmp_path / "out").exists()


# --- atomic output --------------------------------------------------------------------------


def test_existing_model_is_kept_without_force_and_replaced_with_it(
    tiny_gguf, converted, tmp_path, capsys
):
    out = tmp_path / "model"
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    convert_gguf(other, out)
    before = _files(out)
    code, text = _cli(capsys, "--from-gguf", str(tiny_gguf), "--out", str(out))
    assert code == 2 and "already holds a model; pass --force" in text
    assert _files(out) == before
    code, text = _cli(capsys, "--from-gguf", str(tiny_gguf), "--out", str(out), "--force")
    # it names the file it converted, not the model it replaced (transformers' progress bar
    # beside it prints a random rate: match words, not digits)
    assert code == 0 and "converted in" in text and f"{tiny_gguf.name}: llama" in text
    assert other.name not in text
    assert _files(out)["model.safetensors"] == (converted.out / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "other.gguf"]


def test_a_gguf_file_inside_the_model_it_would_replace_is_never_deleted(tiny_gguf, tmp_path):
    out = tmp_path / "model"
    convert_gguf(tiny_gguf, out)
    inside = out / "x.gguf"
    inside.write_bytes(tiny_gguf.read_bytes())
    before = _files(out)
    with pytest.raises(ConversionError, match="would delete the file it is converted from"):
        convert_gguf(inside, out, force=True)
    assert _files(out) == before


def test_empty_out_directory_is_filled(tiny_gguf, tmp_path):
    (tmp_path / "model").mkdir()
    convert_gguf(tiny_gguf, tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_non_model_directory_is_never_replaced(tiny_gguf, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="non-empty directory without a model"):
        convert_gguf(tiny_gguf, tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_failure_while_writing_leaves_the_old_model_and_no_partial_copy(
    tiny_gguf, tmp_path, monkeypatch
):
    from cadence.models import gguf as module

    out = tmp_path / "model"
    convert_gguf(tiny_gguf, out)
    before = _files(out)

    def save_then_fail(model, tokenizer, tmp):
        model.save_pretrained(tmp)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "_save", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(tiny_gguf, out, force=True)
    assert _files(out) == before
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(tiny_gguf, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# --- the real SmolLM2-135M-Instruct file (tests/conftest.py: smollm2_dir) ----------------------

QUESTION = [{"role": "user", "content": "What is 7 + 5?"}]
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir), load_tokenizer(smollm2_dir)


@pytest.mark.slow
def test_smollm2_loads_with_cadence_loaders_as_the_instruct_model(smollm2_dir, smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(tok) == model.config.vocab_size == 49_152
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token) == (
        "<|im_end|>",
        2,
        2,
        "<|im_start|>",
    )
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (2, 2)


@pytest.mark.slow
def test_smollm2_chat_template_renders_as_the_tokenizer_does(smollm2_dir, smollm2):
    """The saved chat_template.jinja, rendered as transformers renders templates, gives the
    tokenizer's prompt, which is ChatML with SmolLM2's default system turn; its markers encode
    as the single special tokens the model was trained on."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _, tok = smollm2
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string((smollm2_dir / "chat_template.jinja").read_text())
    rendered = template.render(messages=QUESTION, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert rendered == CHATML_PROMPT
    ids = tok(rendered).input_ids
    assert ids[:3] == [1, 9690, 198]  # <|im_start|> system \n
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed


@pytest.mark.slow
def test_smollm2_greedy_answer_stops_at_im_end_and_says_12(smollm2):
    """Greedy decoding with nothing but the directory's generation config: the reply ends with
    <|im_end|> well before the cap, and it has the answer."""
    model, tok = smollm2
    ids = tok(CHATML_PROMPT, return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    # one sequence decodes no faster on two threads, and on a busy machine the second one spins:
    # 25 s of CPU against 1.6 s on one thread, measured
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=48, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    reply = out[0, ids.shape[1] :].tolist()
    assert reply[-1] == tok.eos_token_id and len(reply) < 48
    assert "12" in tok.decode(reply, skip_special_tokens=True)
