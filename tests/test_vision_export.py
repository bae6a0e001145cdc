"""Exports of a vision-language model (issue 39): the safetensors export loads as one and is
verified on the images (`ckpt verify` feeds each row's pixels, so a changed vision tower fails even
though text alone would pass); GGUF, ONNX and the other formats, which cannot hold the vision tower
here, are refused before any work with the reason and the fix; a run's export stage verifies its
export on the run's eval rows with their images, and a run asking for a format its VLM cannot take
stops before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli
from PIL import Image

from lmforge.errors import UserInputError
from lmforge.export.convert import convert
from lmforge.models.vision import save_vision_model_dir
from lmforge.pipeline.vlm_starter import write_shapes_starter

PROMPT = "<|im_start|>user\n<image>how many shapes are there?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shapes task (task/) and an untrained tiny SmolVLM-architecture model (model/)."""
    root = tmp_path_factory.mktemp("vlm")
    write_shapes_starter(root, train_rows=100, eval_rows=8)
    return root


def _verify(path: Path, **kwargs: object) -> dict:
    from lmforge.export.verify import verify

    return verify(path, max_rows=4, max_questions=4, prompts=2, new_tokens=4, **kwargs).to_json()  # type: ignore[arg-type]


def test_a_safetensors_export_loads_as_a_vlm_and_is_verified_on_its_images(vlm: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    export = tmp_path / "st"
    convert(vlm / "model", "safetensors", export)
    processor = AutoProcessor.from_pretrained(export)
    image = Image.open(vlm / "task" / "images" / "eval-00001.png").convert("RGB")
    batch = processor(text=[PROMPT], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        source = AutoModelForImageTextToText.from_pretrained(vlm / "model").eval()
        exported = AutoModelForImageTextToText.from_pretrained(export).eval()
        assert torch.equal(exported(**batch).logits, source(**batch).logits)

    # Verified on the eval rows with their images: the same logits, every row's image fed.
    eval_rows = vlm / "task" / "eval.jsonl"
    verdict = _verify(export, data=eval_rows)
    assert verdict["passed"], verdict["failures"]
    assert verdict["images"] == {"checked": True, "rows": 4, "rows_with_images": 4, "images": 4}
    assert verdict["parity"]["logits_max_abs_diff"] == 0.0
    assert verdict["parity"]["ppl_of"] == "the answers' tokens"
    assert verdict["parity"]["accuracy"]["questions"] == 4

    # A model whose vision tower differs: text alone cannot tell, the images can.
    changed = tmp_path / "changed"
    with torch.no_grad():
        source.model.vision_model.embeddings.patch_embedding.weight.mul_(1.5)
    save_vision_model_dir(changed, source, processor)
    blind = _verify(changed, against=vlm / "model")
    assert blind["passed"] and blind["images"]["checked"] is False
    assert "no rows with images" in blind["images"]["why"]
    result = run_cli(
        "ckpt", "verify", str(changed), "--against", str(vlm / "model"), "--data", str(eval_rows),
        "--max-rows", "2", "--prompts", "1", "--new-tokens", "4",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "images: compared with 2 image(s) fed, on 2 of 2 rows" in result.stdout, result.stdout
    assert "FAIL" in result.stdout and "logits max diff" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("fmt", "reason", "fix"),
    [
        ("gguf", "vision projector (mmproj-*.gguf)", "convert_hf_to_gguf.py"),
        ("onnx", "the vision tower and the merge of image features", "--to safetensors"),
        ("compressed-tensors", "does not place the vision tower", "--to safetensors"),
        ("tensorrt-llm", "for text models", "--to safetensors"),
    ],
)
def test_formats_that_cannot_hold_the_vision_tower_are_refused_before_any_work(
    vlm: Path, tmp_path: Path, fmt: str, reason: str, fix: str
) -> None:
    out = tmp_path / fmt
    with pytest.raises(UserInputError) as refused:
        convert(vlm / "model", fmt, out)
    message = str(refused.value)
    assert "vision-language model (idefics3)" in message and reason in message and fix in message, message
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_gguf_of_a_vlm_exits_2_with_the_llama_cpp_commands(vlm: Path, tmp_path: Path) -> None:
    result = run_cli("ckpt", "convert", str(vlm / "model"), "--to", "gguf", "--out", str(tmp_path / "gguf"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    text = " ".join(result.stderr.split())
    assert "--mmproj --outfile mmproj-model.gguf" in text and "llama-mtmd-cli" in text, text


def _run_config(vlm: Path, out: Path, **export: object) -> Path:
    config = {
        "run": {"name": "vlm", "output_dir": str(out / "runs"), "seed": 0},
        "model": {"path": str(vlm / "model")},
        "data": {
            "max_length": 64,
            "train": [{"path": str(vlm / "task" / "train.jsonl"), "max_documents": 16}],
            "eval": [{"path": str(vlm / "task" / "eval.jsonl")}],
        },
        "train": {
            "stage": "sft",
            "method": "lora",
            "max_steps": 2,
            "micro_batch_size": 8,
            "lr": 1e-3,
            "log_every": 2,
            "eval_every": 2,
            "save_every": 2,
            "precision": "fp32",
        },
        "export": export,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_vlm_runs_export_is_verified_on_its_eval_images_and_a_format_it_cannot_take_stops_the_run_first(
    vlm: Path, tmp_path: Path
) -> None:
    refused = run_cli("train", str(_run_config(vlm, tmp_path / "a", formats=["safetensors", "gguf", "onnx"])))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "export.formats: --to gguf" in refused.stderr and "export.formats: --to onnx" in refused.stderr
    assert not (tmp_path / "a" / "runs" / "vlm" / "metrics.jsonl").exists()  # stopped before training

    trained = run_cli("train", str(_run_config(vlm, tmp_path / "b", formats=["safetensors"])))
    assert trained.returncode == 0, trained.stderr[-3000:]
    export = tmp_path / "b" / "runs" / "vlm" / "export"
    summary = json.loads((export / "export.json").read_text())
    verdict = summary["artifacts"]["safetensors"]["verification"]
    assert verdict["passed"], verdict["failures"]
    assert summary["reference"].endswith("final/adapter")  # the adapter on its base, not the merge
    assert verdict["images"] == {"checked": True, "rows": 8, "rows_with_images": 8, "images": 8}
    assert verdict["parity"]["accuracy"]["questions"] == 8
    print("export verify: logits rel diff", verdict["parity"]["logits_rel_diff"])
    assert (export / "safetensors" / "processor_config.json").is_file()
