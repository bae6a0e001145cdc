"""Exports of a vision-language model (issue 39): the safetensors export loads as one and is
verified on the images (`ckpt verify` feeds each row's pixels, so a changed vision tower fails even
though text alone would pass); GGUF, ONNX and the other formats, which cannot hold the vision tower
here, are refused before any work with the reason and the fix; a run's export stage verifies its
export on the run's eval rows with their images, and a run asking for a format its VLM cannot take
stops before training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import run_cli
from PIL import Image

from lmforge.errors import UserInputError
from lmforge.export.convert import convert
from lmforge.export.vision_formats import check_vision_exports
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


def test_gguf_of_a_vlm_whose_processor_keeps_images_whole_exits_2_with_the_reason(
    vlm: Path, tmp_path: Path
) -> None:
    # llama.cpp cuts every Idefics3 image into tiles plus an overview; the tiny preset keeps each whole.
    result = run_cli("ckpt", "convert", str(vlm / "model"), "--to", "gguf", "--out", str(tmp_path / "gguf"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    text = " ".join(result.stderr.split())
    assert "always cuts an Idefics3 image into tiles plus an overview" in text, text
    assert "do_image_splitting False" in text and "export safetensors" in text, text
    assert not list((tmp_path / "gguf").glob("*.gguf")) if (tmp_path / "gguf").exists() else True
    with pytest.raises(UserInputError, match="always cuts an Idefics3 image"):
        check_vision_exports(None, "smolvlm-tiny", ["safetensors", "gguf"])  # a preset run, before training


def tiled_vlm(vlm: Path, out: Path) -> Path:
    """An untrained tiny SmolVLM-architecture model whose processor tiles images as SmolVLM's does
    (64 px longest edge: 2 x 2 tiles of 32 px plus the overview), with the frame tokens llama.cpp
    looks up; random weights are enough to compare two runtimes."""
    from transformers import AddedToken, AutoTokenizer, Idefics3ImageProcessor

    from lmforge.models.vision import build_vision_model

    tokenizer = AutoTokenizer.from_pretrained(vlm / "model")
    tokenizer.add_tokens([AddedToken("\n\n", normalized=False, special=False)])
    tokenizer.add_tokens([f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)], special_tokens=True)
    torch.manual_seed(0)
    model, processor = build_vision_model("smolvlm-tiny", tokenizer)
    processor.image_processor = Idefics3ImageProcessor(
        do_image_splitting=True, size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    save_vision_model_dir(out, model, processor)
    return out


def test_gguf_of_a_tiling_vlm_is_a_text_model_and_a_projector_llama_cpp_reads(
    vlm: Path, tmp_path: Path
) -> None:
    """The pair's layout, read back: every vision tensor under llama.cpp's clip name with the source's
    values, the idefics3 projector keys libmtmd needs, and the text model a llama GGUF that runs (in
    transformers' GGUF reader here, llama.cpp in the integration tier) as the VLM's text model."""
    import gguf
    from safetensors.torch import load_file

    source = tiled_vlm(vlm, tmp_path / "tiled")
    out = tmp_path / "gguf"
    result = run_cli("ckpt", "convert", str(source), "--to", "gguf", "--dtype", "f32", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".gguf") == [
        "mmproj-f32.gguf",
        "model-f32.gguf",
    ]
    assert "llama-mtmd-cli -m model-f32.gguf --mmproj mmproj-f32.gguf" in " ".join(result.stdout.split())

    reader = gguf.GGUFReader(out / "mmproj-f32.gguf")
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert keys["general.architecture"] == "clip" and keys["general.type"] == "mmproj"
    assert keys["clip.projector_type"] == "idefics3" and keys["clip.vision.projector.scale_factor"] == 2
    assert (keys["clip.vision.image_size"], keys["clip.vision.patch_size"]) == (32, 8)
    assert keys["clip.vision.preproc_image_size"] == 64 and keys["clip.vision.projection_dim"] == 128
    assert keys["clip.vision.block_count"] == 2 and keys["clip.vision.image_mean"] == [0.5, 0.5, 0.5]
    weights = load_file(source / "model.safetensors")
    by_gguf_name = {
        "mm.model.fc.weight": "model.connector.modality_projection.proj.weight",
        "v.patch_embd.weight": "model.vision_model.embeddings.patch_embedding.weight",
        "v.position_embd.weight": "model.vision_model.embeddings.position_embedding.weight",
        "v.blk.1.attn_q.weight": "model.vision_model.encoder.layers.1.self_attn.q_proj.weight",
        "v.blk.0.ffn_up.weight": "model.vision_model.encoder.layers.0.mlp.fc1.weight",
        "v.blk.0.ffn_down.bias": "model.vision_model.encoder.layers.0.mlp.fc2.bias",
        "v.post_ln.weight": "model.vision_model.post_layernorm.weight",
    }
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    vision_tensors = [
        name for name in weights if name.startswith(("model.vision_model.", "model.connector."))
    ]
    assert len(tensors) == len(vision_tensors) == 38
    for name, hf_name in by_gguf_name.items():
        assert np.array_equal(
            np.asarray(tensors[name].data).reshape(weights[hf_name].shape), weights[hf_name].numpy()
        )

    text = gguf.GGUFReader(out / "model-f32.gguf")
    assert not any(t.name.startswith(("v.", "mm.")) for t in text.tensors) and len(text.tensors) == 21
    # In transformers' GGUF reader (verify's runtime without llama-cpp-python) the text model runs
    # alone: compared on text, and the verdict says the images were not checked.
    verified = run_cli(
        "ckpt", "verify", str(out), "--against", str(source), "--data", str(vlm / "task" / "eval.jsonl"),
        "--runtime", "transformers", "--max-rows", "2", "--prompts", "1", "--new-tokens", "4",
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    assert "images: NOT checked" in verified.stdout and "takes token ids only" in verified.stdout, (
        verified.stdout
    )


@pytest.mark.integration
def test_the_gguf_pair_runs_in_llama_cpp_on_the_images_and_a_changed_tower_fails(
    vlm: Path, tmp_path: Path
) -> None:
    """llama.cpp (llama-cpp-python's libmtmd) reads each image of the eval rows with its own
    preprocessing and the pair's projector: the same prompt layout as the model's processor, logits
    within the f32 pair's limits, the same greedy answers; a pair whose tower was scaled fails."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lmforge.export.verify import verify

    source = tiled_vlm(vlm, tmp_path / "tiled")
    convert(source, "gguf", tmp_path / "gguf", dtype="f32")
    eval_rows = vlm / "task" / "eval.jsonl"
    verdict = verify(tmp_path / "gguf", data=eval_rows, max_rows=4, prompts=2, new_tokens=6).to_json()
    assert verdict["runtime"] == "llama.cpp (libmtmd)", verdict
    assert verdict["passed"], verdict["failures"]
    assert verdict["images"] == {"checked": True, "rows": 4, "rows_with_images": 4, "images": 4}
    assert verdict["parity"]["top1_agreement"] == 1.0 and verdict["parity"]["greedy_identical"] == 1.0
    print("gguf pair in llama.cpp: logits rel diff", verdict["parity"]["logits_rel_diff"])

    changed = tmp_path / "changed"
    model = AutoModelForImageTextToText.from_pretrained(source)
    with torch.no_grad():
        model.model.vision_model.embeddings.patch_embedding.weight.mul_(1.5)
    save_vision_model_dir(changed, model, AutoProcessor.from_pretrained(source))
    convert(changed, "gguf", tmp_path / "changed-gguf", dtype="f32")
    failed = verify(
        tmp_path / "changed-gguf", against=source, data=eval_rows, max_rows=4, prompts=1, new_tokens=4
    )
    assert not failed.passed and any("logits max diff" in failure for failure in failed.failures), (
        failed.failures
    )


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
