"""The GGUF -> mlx-lm converter on a small synthetic qwen2 GGUF."""

import json

import mlx.core as mx
import numpy as np
import pytest
from synthetic_gguf import CONFIG, SPECIALS, write_gguf

from flash_eval.gguf_convert import ConversionError, convert_gguf, hf_name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    expected = write_gguf(root / "tiny.gguf")
    out = root / "model"
    config = convert_gguf(root / "tiny.gguf", out)
    return out, config, expected


def test_config_from_metadata(converted):
    out, config, _ = converted
    on_disk = json.loads((out / "config.json").read_text())
    assert on_disk == config
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] == CONFIG["hidden"] and config["num_hidden_layers"] == CONFIG["layers"]
    assert config["num_attention_heads"] == CONFIG["heads"] and config["num_key_value_heads"] == CONFIG["kv_heads"]
    assert config["rms_norm_eps"] == CONFIG["eps"] and config["rope_theta"] == CONFIG["rope"]
    assert config["tie_word_embeddings"] is False


def test_every_weight_arrives_in_hf_layout(converted):
    out, _, expected = converted
    weights = mx.load(str(out / "model.safetensors"))
    assert set(weights) == {hf_name(n) for n in expected}
    for name, values in expected.items():
        got = np.array(weights[hf_name(name)])
        assert got.shape == values.shape, name
        np.testing.assert_array_equal(got, values, err_msg=name)


def test_mlx_lm_loads_it_and_the_tokenizer_round_trips(converted):
    from mlx_lm import load

    out, _, _ = converted
    model, tokenizer = load(str(out))
    text = "the thin inner then"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were applied
    # Control tokens are single, special tokens; the chat template came along.
    assert tokenizer.encode("<|im_start|>") == [tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(SPECIALS) + 256 + 8)
    assert not mx.isnan(logits).any()


def test_other_architectures_are_refused(tmp_path):
    write_gguf(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ConversionError, match="only qwen2"):
        convert_gguf(tmp_path / "llama.gguf", tmp_path / "out")


def test_bad_dtype(tmp_path):
    with pytest.raises(ConversionError, match="dtype"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", dtype="int8")
