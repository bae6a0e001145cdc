"""`lmforge ckpt convert --to onnx`: export -> run in onnxruntime -> compare with the torch model.

Two exports keep the file fast: llama at f32 with external data forced, qwen2 at f16 through
the CLI (single file). Differences are relative to the largest |logit| (about 2.5 here), as in
the converter and `ckpt verify`. f32: onnxruntime and torch compute the same graph and differ
only in reduction order (measured 8e-7 relative), so 1e-5 leaves a 10x margin while a wrong
mask, position or weight shows up at 1e-2 or more. f16: the f16 spacing at |logit| 2.5 is
2e-3 (8e-4 relative) and the graph rounds at every op; measured 2e-3 relative against the f32
torch model (a few f16 steps), limit 1e-2 (about ten).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import CheckpointError, UserInputError
from lmforge.export.convert import convert
from lmforge.export.to_onnx import OnnxCausalLM, check_parity, convert_to_onnx
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

F32_RTOL = 1e-5
F16_RTOL = 1e-2


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(
        ["the cat sat on the mat\n", "one two three\n"] * 50, TokenizerTrainConfig(vocab_size=300)
    )


def save_model(tokenizer, out: Path, preset: str) -> Path:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, config=SMALL_ARCH), tokenizer, max_length=64)
    # A fresh init (std 0.02) with tied embeddings just repeats the input token under greedy
    # decoding; larger weights give varied continuations and logits of magnitude ~2.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed" in name:
                param.mul_(5)
            elif param.dim() == 2:
                param.normal_(0, 0.15)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    return save_model(tokenizer, tmp_path_factory.mktemp("llama") / "model", "llama-tiny")


@pytest.fixture(scope="module")
def llama_onnx(llama: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The llama export at f32, in the >2 GB layout: a threshold of 0 forces the weights out to
    model.onnx.data on a tiny model. (The CLI test below covers the single-file layout.)"""
    out = tmp_path_factory.mktemp("export") / "onnx"
    out.mkdir()
    return convert_to_onnx(llama, out, dtype="f32", external_data_threshold=0)


def torch_logits(source: Path, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.numpy()


def batch(vocab: int, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids, every row but the first left-padded by a different amount."""
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row in range(1, rows):
        mask[row, : 2 * row] = 0
    return ids, mask


def assert_parity(export: Path, source: Path, rtol: float) -> float:
    """Logits on shapes other than the export's example (batch and sequence are dynamic); the
    largest difference relative to the largest |logit| (at least 1), as the converter and verify do."""
    ids, mask = batch(280, 3, 13)
    ours = OnnxCausalLM(export).run(ids.numpy(), mask.numpy())
    theirs = torch_logits(source, ids, mask)
    valid = mask.numpy().astype(bool)
    diff = float(np.abs(ours[valid] - theirs[valid]).max()) / max(1.0, float(np.abs(theirs[valid]).max()))
    assert diff <= rtol, diff
    single = OnnxCausalLM(export).logits([7])  # batch 1, one token
    assert single.shape == (1, theirs.shape[-1])
    print(f"{export.name}: relative logit difference {diff:.3g}")
    return diff


def test_llama_export_matches_torch_with_external_data(llama: Path, llama_onnx) -> None:  # type: ignore[no-untyped-def]
    out = llama_onnx.out
    assert llama_onnx.details["max_rel_diff"] <= F32_RTOL and llama_onnx.details["kv_cache"] is False
    assert llama_onnx.details["external_data"] is True and out / "model.onnx.data" in llama_onnx.files
    onnx.checker.check_model(str(out / "model.onnx"))
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in graph.output] == ["logits"]
    external = [i for i in graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external and {i.data_type for i in external} == {onnx.TensorProto.FLOAT}
    assert (out / "model.onnx.data").stat().st_size >= 0.9 * llama_onnx.details["weight_bytes"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (llama / name).read_bytes()  # self-contained
    assert_parity(out, llama, F32_RTOL)


def test_greedy_equals_hf_generate(llama: Path, llama_onnx) -> None:  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    runtime = OnnxCausalLM(llama_onnx.out)
    for prompt in ([5, 17, 42], [3, 9, 100, 7, 64, 2]):
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=[0], pad_token_id=1
            )
        expected = generated[0, len(prompt) :].tolist()
        assert len(set(expected)) > 1  # a real continuation, not one token repeated
        assert runtime.greedy(prompt, 12, stop_ids={0}) == expected
    assert len(runtime.greedy([5, 17, 42], 4)) == 4  # without stop ids: exactly max_new_tokens


def test_a_mismatch_fails_loudly(llama_onnx) -> None:  # type: ignore[no-untyped-def]
    ids, mask = batch(280, 2, 9)
    reference = OnnxCausalLM(llama_onnx.out).run(ids.numpy(), mask.numpy())
    check_parity(llama_onnx.out, ids.numpy(), mask.numpy(), reference, "f32")  # itself: passes
    reference[0, 3, 7] += 0.01  # one logit off by 1e-2: far above the f32 limit
    with pytest.raises(CheckpointError, match="onnxruntime logits differ from the torch model's"):
        check_parity(llama_onnx.out, ids.numpy(), mask.numpy(), reference, "f32")
    reference[0, 3, 7] = np.nan
    with pytest.raises(CheckpointError):
        check_parity(llama_onnx.out, ids.numpy(), mask.numpy(), reference, "f32")


def test_cli_exports_qwen2_at_f16(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "qwen2", "qwen2-tiny")
    out = tmp_path / "onnx"
    result = run_cli("ckpt", "convert", str(source), "--to", "onnx", "--dtype", "f16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "converted" in result.stdout and "model.onnx" in result.stdout
    details = json.loads((out / "lmforge_export.json").read_text())["details"]
    assert details["external_data"] is False and not (out / "model.onnx.data").exists()
    assert details["max_rel_diff"] <= details["tolerance_rel"]
    graph = onnx.load(str(out / "model.onnx")).graph
    assert onnx.TensorProto.FLOAT16 in {i.data_type for i in graph.initializer}
    assert assert_parity(out, source, F16_RTOL) > 1e-6  # against the f32 torch model; really f16


def test_bad_input(llama: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="--dtype 'bf16'"):
        convert(llama, "onnx", tmp_path / "a", dtype="bf16")
    (tmp_path / "final" / "adapter").mkdir(parents=True)
    with pytest.raises(UserInputError, match="merge-lora"):
        convert(tmp_path / "final", "onnx", tmp_path / "b")
