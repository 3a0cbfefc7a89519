"""GGUF -> Hugging Face conversion, checked against transformers' own GGUF loader on tiny synthetic models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dflash2.models.gguf_convert import (  # noqa: E402
    GGUFConvertError,
    convert_gguf,
    hf_tensor_name,
    normalize_dtype,
    unpermute_rows,
    write_safetensors_streaming,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (``bytes_to_unicode``), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE vocabulary with ChatML specials."""
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d", "e r", "o n", "Ġ w"]
    tokens = _byte_alphabet() + ["".join(m.split(" ")) for m in merges] + list(SPECIAL_TOKENS)
    types = [1] * (len(tokens) - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS)
    return tokens, types, merges


def write_tiny_gguf(
    path: Path,
    arch: str,
    *,
    quantize: bool = True,
    tied: bool | None = None,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 96,
    seed: int = 0,
    tokenizer: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A random Llama ("llama") or Qwen2 ("qwen2") GGUF with a byte-level BPE tokenizer.

    ``quantize`` stores the 2-D projection weights as Q8_0 (rows of 64 values are two Q8_0 blocks).
    ``tied`` defaults to True for llama (no output.weight) and False for qwen2 (output.weight present).
    """
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocabulary()
    vocab = len(tokens) + 6  # a few unused rows past the tokenizer, as real models have
    head_dim = hidden // heads
    tied = (arch == "llama") if tied is None else tied
    q8 = gguf.GGMLQuantizationType.Q8_0

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)])
        writer.add_token_types(types + [5] * (vocab - len(tokens)))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|im_start|>") if arch == "llama" else tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], scale: float = 0.08, quantizable: bool = True) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            values = (1.0 + rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantize and quantizable and values.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", (vocab, hidden), scale=0.5)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (heads * head_dim,), scale=0.3)
            add(f"blk.{i}.attn_k.bias", (kv_heads * head_dim,), scale=0.3)
            add(f"blk.{i}.attn_v.bias", (kv_heads * head_dim,), scale=0.3)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), quantizable=ffn % 32 == 0)
    add("output_norm.weight", (hidden,))
    if not tied:
        add("output.weight", (vocab, hidden), scale=0.5)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, the transform being undone."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _load_gguf_with_transformers(path: Path):
    pytest.importorskip("accelerate")  # transformers refuses gguf_file= without it
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _load_converted(directory: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, output_loading_info=True)
    return model.eval(), info


# ------------------------------------------------------------------------------------------------ names


def test_tensor_names_map_to_transformers():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(GGUFConvertError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (4, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, n_kv):
    head_dim = 8
    rng = np.random.default_rng(1)
    q = rng.standard_normal((n_head * head_dim, 16)).astype(np.float32)
    k = rng.standard_normal((n_kv * head_dim, 16)).astype(np.float32)
    bias = rng.standard_normal(n_kv * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(q, n_head, n_head), n_head), q)
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    np.testing.assert_array_equal(unpermute_rows(_llama_cpp_permute(bias, n_head, n_kv), n_kv), bias)


def test_normalize_dtype():
    assert normalize_dtype("bfloat16") == "bf16"
    assert normalize_dtype("FP32") == "fp32"
    assert normalize_dtype("half") == "fp16"
    with pytest.raises(ValueError, match="unknown dtype"):
        normalize_dtype("int4")


def test_streaming_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b.weight": torch.randn(7), "c": torch.randn(2, 2, 2)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        path = tmp_path / f"x-{dtype}.safetensors"
        cast = {k: v.to(dtype) for k, v in tensors.items()}
        write_safetensors_streaming(path, [(k, tuple(v.shape)) for k, v in cast.items()], cast.values(), dtype)
        loaded = load_file(str(path))
        assert loaded.keys() == cast.keys()
        for key, value in cast.items():
            assert loaded[key].dtype == dtype
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- the oracle comparison


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantize", [True, False], ids=["q8_0", "f32"])
def test_converted_logits_match_transformers_gguf_loader(tmp_path, arch, quantize):
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, quantize=quantize)
    out = convert_gguf(path, tmp_path / "fp32", "fp32", progress=False)

    converted, info = _load_converted(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    reference = _load_gguf_with_transformers(path)

    ids = torch.tensor([[5, 100, 7, 260, 42, 3, 11, 200, 199, 64, 1, 270]])  # [batch 1, 12]
    with torch.no_grad():
        ours = converted(ids).logits  # [1, 12, vocab]
        theirs = reference(ids).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_llama_without_unpermute_would_differ(tmp_path):
    """The oracle test has teeth: skipping llama.cpp's Q/K permutation changes the logits."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", quantize=False)
    out = convert_gguf(path, tmp_path / "fp32", "fp32", progress=False)
    weights = load_file(str(out / "model.safetensors"))
    with torch.no_grad():
        ids = torch.tensor([[5, 100, 7, 260, 42, 3]])
        good = _load_converted(out)[0](ids).logits
        for name in list(weights):
            if ".q_proj." in name:
                weights[name] = torch.from_numpy(_llama_cpp_permute(weights[name].numpy(), 4, 4))
            elif ".k_proj." in name:
                weights[name] = torch.from_numpy(_llama_cpp_permute(weights[name].numpy(), 4, 2))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        bad = _load_converted(out)[0](ids).logits
    assert (good - bad).abs().max() > 1e-3


# ----------------------------------------------------------------------------------- the written directory


def test_llama_directory_contents(tmp_path):
    from safetensors import safe_open

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    out = convert_gguf(path, tmp_path / "bf16", "bf16", source={"model": "tiny"}, progress=False)
    config = json.loads((out / "config.json").read_text())
    tokens, _, _ = tiny_vocabulary()
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is False
    assert config["vocab_size"] == len(tokens) + 6
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert config["head_dim"] == 16 and config["max_position_embeddings"] == 256
    assert config["rope_scaling"] is None and config["rope_theta"] == 10000.0
    assert config["torch_dtype"] == "bfloat16"
    assert config["eos_token_id"] == tokens.index("<|im_end|>")
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        assert "lm_head.weight" not in weights.keys()
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    generation = json.loads((out / "generation_config.json").read_text())
    # eos first, then the vocabulary's other end-of-generation control tokens (llama.cpp's rule)
    assert generation["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    source = json.loads((out / "dflash2_source.json").read_text())
    assert source["model"] == "tiny" and source["dtype"] == "bf16" and source["architecture"] == "llama"
    converted, info = _load_converted(out, dtype=torch.bfloat16)
    assert not info["missing_keys"]
    assert converted.model.embed_tokens.weight.dtype == torch.bfloat16


def test_qwen2_keeps_untied_lm_head(tmp_path):
    from safetensors import safe_open

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    out = convert_gguf(path, tmp_path / "fp16", "fp16", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        keys = set(weights.keys())
        assert "lm_head.weight" in keys and "model.layers.1.self_attn.k_proj.bias" in keys
        embed = weights.get_tensor("model.embed_tokens.weight")
        head = weights.get_tensor("lm_head.weight")
    assert embed.dtype == torch.float16 and not torch.equal(embed, head)


def test_tokenizer_files_carry_template_and_eos(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2")
    out = convert_gguf(path, tmp_path / "fp32", "fp32", progress=False)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|im_end|>"

    ours = AutoTokenizer.from_pretrained(str(out))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the and the wander<|im_end|> in on"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == tiny_vocabulary()[0].index("<|im_end|>")
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_without_tokenizer_converts_weights_only(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tokenizer=False)
    out = convert_gguf(path, tmp_path / "fp32", "fp32", progress=False)
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFConvertError, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", "fp32", progress=False)


def test_unknown_tensor_is_refused(tmp_path):
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", extra_tensors=extra)
    with pytest.raises(GGUFConvertError, match="attn_sinks"):
        convert_gguf(path, tmp_path / "out", "fp32", progress=False)
