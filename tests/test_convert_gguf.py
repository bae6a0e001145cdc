"""`lmforge ckpt convert --to gguf`: convert tiny Llama / Qwen2 / Mistral models, read the GGUF back
through transformers' GGUF reader (and gguf.GGUFReader) and compare with the source model.

Tolerances, as max|logits_gguf - logits_src| / max|logits_src| over a 12-token sequence
(transformers dequantizes the file to float32, so only the storage rounding shows):
- f32: the same numbers in another container -> 1e-5 absolute (measured 0.0).
- f16: each weight rounded to an 11-bit significand (relative error <= 2**-11 = 4.9e-4 per
  weight) -> 2e-3 (measured 2.0e-4 llama/mistral, 2.3e-4 qwen2).
- bf16: 8-bit significand (<= 2**-8 = 3.9e-3 per weight) -> 2e-2 (measured 1.9e-3 / 1.6e-3).
- q8_0: 8-bit integers with one f16 scale per 32 weights, error <= max|block| / 254 per
  weight, about 2x bf16's -> 3e-2 (measured 6.6e-3 / 4.8e-3). Norms stay f32 in every mode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaTokenizer

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.chat_templates import LLAMA3_TEMPLATE
from lmforge.data.tokenizer import CHATML_TEMPLATE, train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.convert import convert
from lmforge.export.gguf_encoding import rope_permute
from lmforge.export.gguf_runtime import TransformersGgufModel, greedy_decode
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

TEXTS = ["the cat sat on the mat\n", "one two three four five\n", "Hello, world! 123 more text.\n"]
SAMPLES = ["the cat sat on the mat", "Hello, world!\n\n  one  two 12345 ünïcode ✓", " leading space"]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "the cat?"},
    {"role": "assistant", "content": "sat on the mat"},
    {"role": "user", "content": "one two"},
]
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2, "q8_0": 3e-2}  # see the module docstring
IDS = [5, 60, 100, 7, 200, 3, 2, 50, 31, 250, 9, 1]


@pytest.fixture(scope="module")
def bpe_tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))


@pytest.fixture(scope="module")
def spm_tokenizer() -> LlamaTokenizer:
    return make_spm_tokenizer()


def make_spm_tokenizer() -> LlamaTokenizer:
    """A SentencePiece-style tokenizer (BPE over ▁-prefixed words with byte fallback, Llama 2's
    layout), trained on the spot, with ChatML tokens and template."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(TEXTS * 50, trainer=trainer)
    spec = json.loads(backend.to_str())["model"]
    tokenizer = LlamaTokenizer(
        vocab=spec["vocab"],
        merges=[tuple(merge) for merge in spec["merges"]],
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def save_model(tokenizer, out: Path, preset: str, **arch: object) -> Path:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, config={**SMALL_ARCH, **arch}), tokenizer, max_length=64)
    with torch.no_grad():  # visible norm weights, so a norm written wrongly shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out, max_shard_size="200KB")  # several shards: the reader follows the index
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models_dir(bpe_tokenizer, spm_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_model(bpe_tokenizer, root / "llama", "llama-tiny"),
        "qwen2": save_model(bpe_tokenizer, root / "qwen2", "qwen2-tiny"),
        "mistral": save_model(bpe_tokenizer, root / "mistral", "mistral-tiny"),
        "qwen2-untied": save_model(
            bpe_tokenizer, root / "qwen2-untied", "qwen2-tiny", tie_word_embeddings=False
        ),
        "llama-spm": save_model(spm_tokenizer, root / "llama-spm", "llama-tiny"),
    }


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def source_logits(path: Path) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("llama", "f32"),
        ("llama", "f16"),
        ("llama", "bf16"),
        ("llama", "q8_0"),
        ("qwen2", "f32"),
        ("qwen2", "q8_0"),
        ("mistral", "f32"),
        ("mistral", "q8_0"),
        ("qwen2-untied", "f32"),
        ("llama-spm", "f16"),
    ],
)
def test_gguf_logits_match_source(models_dir: dict[str, Path], tmp_path: Path, name: str, dtype: str) -> None:
    result = convert(models_dir[name], "gguf", tmp_path, dtype=dtype)
    path = tmp_path / f"model-{dtype}.gguf"
    assert result.files == [path, tmp_path / "Modelfile"]
    assert result.details["bytes"] == path.stat().st_size and result.details["dtype"] == dtype
    expected = source_logits(models_dir[name])
    got = TransformersGgufModel(path).logits(IDS)
    assert got.shape == expected.shape
    if dtype == "f32":
        assert np.abs(got - expected).max() <= TOLERANCE["f32"]
    else:
        assert relative_error(got, expected) <= TOLERANCE[dtype], relative_error(got, expected)


def test_gguf_greedy_matches_source_f32(models_dir: dict[str, Path], tmp_path: Path) -> None:
    convert(models_dir["llama"], "gguf", tmp_path, dtype="f32")
    source = AutoModelForCausalLM.from_pretrained(str(models_dir["llama"])).eval()
    runtime = TransformersGgufModel(tmp_path / "model-f32.gguf")
    assert runtime.greedy(IDS[:5], 8) == greedy_decode(source, IDS[:5], 8)


def fields(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, {
        t.name: t for t in reader.tensors
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_gguf_metadata_and_tensor_types(models_dir: dict[str, Path], tmp_path: Path, name: str) -> None:
    convert(models_dir[name], "gguf", tmp_path, dtype="q8_0")
    meta, tensors = fields(tmp_path / "model-q8_0.gguf")
    config = json.loads((models_dir[name] / "config.json").read_text())
    arch = "qwen2" if name == "qwen2" else "llama"  # llama.cpp runs Mistral as its llama graph
    assert meta["general.architecture"] == arch
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    expected = {
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
    }
    for key, value in expected.items():
        assert meta[f"{arch}.{key}"] == value, key
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    assert len(tensors) == 2 + config["num_hidden_layers"] * (9 + (3 if name == "qwen2" else 0))
    for tensor_name, tensor in tensors.items():
        expect = gguf.GGMLQuantizationType.F32 if len(tensor.shape) == 1 else gguf.GGMLQuantizationType.Q8_0
        assert tensor.tensor_type == expect, tensor_name
    assert meta["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == ("qwen2" if name == "qwen2" else "gpt-2")
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir[name]))
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert meta["tokenizer.ggml.padding_token_id"] == tokenizer.pad_token_id
    assert meta["tokenizer.ggml.eot_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert meta["tokenizer.ggml.add_bos_token"] is False
    types = meta["tokenizer.ggml.token_type"]
    assert isinstance(types, list) and types[tokenizer.eos_token_id] == gguf.TokenType.CONTROL


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-spm"])
def test_gguf_tokenizer_encodes_like_source(models_dir: dict[str, Path], tmp_path: Path, name: str) -> None:
    convert(models_dir[name], "gguf", tmp_path, dtype="f16")
    source = AutoTokenizer.from_pretrained(str(models_dir[name]))
    read_back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model-f16.gguf")
    prompt = source.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert read_back.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == prompt
    for text in [*SAMPLES, prompt]:
        assert read_back(text)["input_ids"] == source(text)["input_ids"], text
    assert read_back.eos_token == source.eos_token


def test_sentencepiece_metadata(models_dir: dict[str, Path], tmp_path: Path) -> None:
    result = convert(models_dir["llama-spm"], "gguf", tmp_path, dtype="f32")
    assert result.details["tokenizer_model"] == "llama"
    meta, _ = fields(tmp_path / "model-f32.gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir["llama-spm"]))
    tokens, types, scores = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    assert isinstance(tokens, list) and isinstance(types, list) and isinstance(scores, list)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    assert types[tokens.index("<0x0A>")] == gguf.TokenType.BYTE
    assert types[tokenizer.unk_token_id] == gguf.TokenType.UNKNOWN
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert meta["tokenizer.ggml.unknown_token_id"] == tokenizer.unk_token_id
    # The first merge makes the best-scoring token: llama.cpp merges by score.
    first = tokens.index("".join(meta["tokenizer.ggml.merges"][0].split(" ")))  # type: ignore[index, union-attr]
    assert scores[first] == max(scores[i] for i, t in enumerate(tokens) if len(t) > 1 and types[i] == 1)


def test_modelfile_chatml_and_untranslatable(
    models_dir: dict[str, Path], tmp_path: Path, bpe_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    convert(models_dir["llama"], "gguf", tmp_path / "chatml", dtype="q8_0")
    modelfile = (tmp_path / "chatml" / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-q8_0.gguf\n")
    assert (
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n' in modelfile
    )
    assert '{{ end }}<|im_start|>assistant\n"""' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and 'PARAMETER stop "<|endoftext|>"' in modelfile

    other = tmp_path / "llama3-src"
    save_model(bpe_tokenizer, other, "llama-tiny")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3_TEMPLATE}))
    convert(other, "gguf", tmp_path / "llama3", dtype="q8_0")
    modelfile = (tmp_path / "llama3" / "Modelfile").read_text()
    assert "TEMPLATE" not in modelfile and "not translated" in modelfile
    meta, _ = fields(tmp_path / "llama3" / "model-q8_0.gguf")
    assert meta["tokenizer.chat_template"] == LLAMA3_TEMPLATE


def test_rope_permute_interleaves_halves() -> None:
    # one head of dim 4: rows [r0 r1 | r2 r3] (HF halves) -> [r0 r2 r1 r3] (llama.cpp pairs)
    rows = torch.arange(8.0).reshape(8, 1)  # 2 heads
    assert rope_permute(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_bad_inputs_raise_user_errors(tmp_path: Path, models_dir: dict[str, Path]) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="no config.json"):
        convert(tmp_path / "empty", "gguf", tmp_path / "o", dtype="f16")
    with pytest.raises(UserInputError, match="choose one of f32, f16, bf16, q8_0"):
        convert(models_dir["llama"], "gguf", tmp_path / "o", dtype="q4_k")
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((models_dir["llama"] / "config.json").read_text())
    with pytest.raises(UserInputError, match="no model.safetensors") as raised:
        convert(bare, "gguf", tmp_path / "o", dtype="f16")
    assert str(bare) in str(raised.value) and "--allow-bin" in str(raised.value)


def test_cli_convert_and_unsupported_model(
    models_dir: dict[str, Path], bpe_tokenizer, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    done = run_cli("ckpt", "convert", str(models_dir["qwen2"]), "--to", "gguf", "--out", str(tmp_path / "q"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "q" / "model-f16.gguf").is_file() and (tmp_path / "q" / "Modelfile").is_file()

    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    tiny_gpt2 = ModelConfig(preset="gpt2-tiny", config={"n_embd": 32, "n_layer": 1, "n_head": 2})
    build_model(tiny_gpt2, bpe_tokenizer, max_length=64).save_pretrained(gpt2)
    failed = run_cli("ckpt", "convert", str(gpt2), "--to", "gguf", "--out", str(tmp_path / "g"))
    assert failed.returncode == 2
    message = failed.stdout + failed.stderr
    assert str(gpt2 / "config.json") in message.replace("\n", "")
    assert (
        "model_type 'gpt2'" in message and "llama, mistral, mixtral, qwen2, qwen2_moe, qwen3_moe" in message
    )


def test_llama3_rope_scaling_becomes_rope_freqs(bpe_tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    source = save_model(bpe_tokenizer, tmp_path / "src", "llama-tiny", rope_parameters=rope)
    convert(source, "gguf", tmp_path / "out", dtype="f16")
    _, tensors = fields(tmp_path / "out" / "model-f16.gguf")
    written = np.asarray(tensors["rope_freqs.weight"].data)
    # transformers' own Llama 3.1 inverse frequencies: default / scaled = llama.cpp's per-frequency factor
    config = AutoConfig.from_pretrained(str(source))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    default = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = (default / scaled.double()).numpy()
    assert written.dtype == np.float32 and written.shape == expected.shape
    assert np.allclose(written, expected, rtol=1e-5) and expected.max() > 1.0


def test_llama_cpp_runtime_missing_says_how_to_install(
    models_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmforge.export.gguf_runtime import LlamaCppModel

    convert(models_dir["llama"], "gguf", tmp_path, dtype="q8_0")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when it is not installed
    with pytest.raises(UserInputError, match="pip install llama-cpp-python"):
        LlamaCppModel(tmp_path / "model-q8_0.gguf")
    with pytest.raises(UserInputError, match="not a .gguf file"):
        LlamaCppModel(tmp_path / "Modelfile")


def test_q8_0_quantization_is_bit_exact_with_gguf_py() -> None:
    """lmforge quantizes in torch; the bytes must equal gguf.quants' reference implementation."""
    import gguf
    import numpy as np

    from lmforge.export.gguf_encoding import quantize_q8_0

    torch.manual_seed(0)
    rows = torch.randn(300, 96) * torch.logspace(-3, 2, 300).unsqueeze(1)
    rows[0] = 0.0  # an all-zero block: scale 0
    rows[1, :32] = torch.arange(32) * 127 / 62.0  # values landing exactly on .5 after scaling
    ours = quantize_q8_0(rows)
    reference = gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.dtype == reference.dtype == np.uint8 and ours.shape == reference.shape
    assert np.array_equal(ours, reference)


def test_modelfile_keeps_qwen2s_default_system_prompt() -> None:
    """Qwen2's template adds "You are a helpful assistant." to a chat without a system message,
    so every training sample carried it: the Modelfile's SYSTEM gives it to Ollama too. Plain
    ChatML has no default, and gets no SYSTEM line."""
    from lmforge.data.chat_templates import BUILTIN_TEMPLATES
    from lmforge.export.gguf_modelfile import render_modelfile

    tokenizer = make_spm_tokenizer()
    assert "SYSTEM" not in render_modelfile("m.gguf", tokenizer)  # ChatML
    tokenizer.chat_template = BUILTIN_TEMPLATES["qwen2"]
    modelfile = render_modelfile("m.gguf", tokenizer)
    assert 'SYSTEM """You are a helpful assistant."""' in modelfile and "TEMPLATE" in modelfile


def test_sharded_sentencepiece_llama_streams_in_blocks(
    models_dir: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights are read and converted a few rows at a time (here 3 rows, less than a head, as a large
    model's blocks are a slice of its embedding): every tensor of a sharded SentencePiece Llama equals
    its whole-tensor encoding, for every --dtype."""
    from safetensors.torch import load_file

    from lmforge.export import gguf_encoding

    source = models_dir["llama-spm"]
    shards = sorted(source.glob("*.safetensors"))
    assert len(shards) > 1
    monkeypatch.setattr(gguf_encoding, "_BLOCK_BYTES", 1000)
    config = json.loads((source / "config.json").read_text())
    state = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    vocab = len(AutoTokenizer.from_pretrained(str(source)))
    threads = torch.get_num_threads()
    for dtype in ("f32", "f16", "bf16", "q8_0"):
        convert(source, "gguf", tmp_path / dtype, dtype=dtype)
        assert torch.get_num_threads() == threads  # the conversion's one thread is given back
        meta, tensors = fields(tmp_path / dtype / f"model-{dtype}.gguf")
        assert meta["tokenizer.ggml.model"] == "llama"
        assert len(meta["tokenizer.ggml.tokens"]) == vocab == config["vocab_size"]  # type: ignore[arg-type]
        assert len(tensors) == len(state)
        for hf_name, weight in state.items():
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert name is not None
            heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
            if name.split(".")[-2] in heads:
                weight = rope_permute(weight, heads[name.split(".")[-2]])
            if weight.dim() == 1 or dtype == "f32":
                expected = weight.float().numpy()
            elif dtype == "f16":
                expected = weight.half().numpy()
            elif dtype == "bf16":
                expected = weight.bfloat16().view(torch.int16).numpy()
            else:
                expected = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            assert np.asarray(tensors[name].data).tobytes() == expected.tobytes(), (dtype, name)


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-spm"])
def test_tokenizer_loads_as_auto_tokenizer_does(models_dir: dict[str, Path], name: str) -> None:
    """load_tokenizer skips building the model's config class (memory) yet picks the same class."""
    from lmforge.export.gguf_tokenizer import load_tokenizer

    config = json.loads((models_dir[name] / "config.json").read_text())
    ours = load_tokenizer(models_dir[name], config)
    reference = AutoTokenizer.from_pretrained(str(models_dir[name]))
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.special_tokens_map == reference.special_tokens_map
