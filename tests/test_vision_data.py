"""Issue 39's first pieces: image references in rows (paths, file:// URLs, OpenAI image parts) and
the bad-row reasons for images that cannot be trained on; the shapes task lmforge writes itself;
a tiny SmolVLM-architecture model built from a config that saves and reloads through the Auto
classes with the same logits."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.images import (
    IMAGE_COUNT,
    IMAGE_MISSING,
    IMAGE_PART,
    IMAGE_TOO_LARGE,
    IMAGE_UNREADABLE,
    IMAGE_URL,
    ImageError,
    check_row_images,
    openai_content_text,
)
from lmforge.data.shapes import COLOURS, COUNT_WORDS, write_shapes_task
from lmforge.data.tokenizer import train_tokenizer
from lmforge.models.vision import build_vision_model


def _digest(folder: Path) -> str:
    hashed = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            hashed.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
    return hashed.hexdigest()


def test_the_shapes_task_is_the_same_for_a_seed_and_its_answers_are_the_images(tmp_path: Path) -> None:
    first = write_shapes_task(tmp_path / "a", train_rows=40, eval_rows=10, seed=3)
    write_shapes_task(tmp_path / "b", train_rows=40, eval_rows=10, seed=3)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    rows = [json.loads(line) for line in first.train.read_text().splitlines()]
    assert len(rows) == 40
    answers = {row["conversations"][1]["value"] for row in rows}
    assert answers <= set(COLOURS) | set(COUNT_WORDS) and len(answers) >= 4
    for row in rows:
        question = row["conversations"][0]["value"]
        assert question.startswith("<image>")
        facts = check_row_images([question], row["images"], first.train.parent, max_pixels=10_000)
        assert (facts[0].width, facts[0].height) == (32, 32)
        if row["conversations"][1]["value"] in COLOURS:  # the named colour is really in the image
            pixels = set(Image.open(facts[0].path).convert("RGB").getdata())
            assert COLOURS[row["conversations"][1]["value"]] in pixels


def test_each_unusable_image_is_a_bad_row_with_its_reason(tmp_path: Path) -> None:
    Image.new("RGB", (40, 30), "white").save(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really" * 10)
    cases = {
        IMAGE_COUNT: (["<image><image>look"], ["ok.png"]),
        IMAGE_MISSING: (["<image>look"], ["gone.png"]),
        IMAGE_UNREADABLE: (["<image>look"], ["corrupt.png"]),
        IMAGE_TOO_LARGE: (["<image>look"], ["ok.png"]),  # 1,200 pixels over a limit of 1,000
        IMAGE_URL: (["<image>look"], ["https://example.com/cat.png"]),
    }
    for reason, (texts, refs) in cases.items():
        with pytest.raises(ImageError) as caught:
            check_row_images(texts, refs, tmp_path, max_pixels=1_000)
        assert caught.value.reason == reason, caught.value
    # A path relative to the data file's folder and a file:// URL name the same image.
    uri = (tmp_path / "ok.png").as_uri()
    facts = check_row_images(["<image>a<image>b"], ["ok.png", uri], tmp_path, max_pixels=10_000)
    assert [f.path.resolve() for f in facts] == [(tmp_path / "ok.png").resolve()] * 2


def test_openai_image_parts_become_placeholders_in_order() -> None:
    refs: list[str] = []
    content = [
        {"type": "text", "text": "compare "},
        {"type": "image_url", "image_url": {"url": "a.png"}},
        {"type": "text", "text": " with "},
        {"type": "image", "image": "b.png"},
    ]
    assert openai_content_text(content, refs) == "compare <image> with <image>"
    assert refs == ["a.png", "b.png"]
    with pytest.raises(ImageError) as caught:
        openai_content_text([{"type": "audio", "audio": "x.wav"}], [])
    assert caught.value.reason == IMAGE_PART


def test_a_tiny_vlm_from_a_config_trains_saves_and_reloads_with_the_same_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    task = write_shapes_task(tmp_path / "task", train_rows=8, eval_rows=2)
    rows = [json.loads(line) for line in task.train.read_text().splitlines()]
    texts = [turn["value"] for row in rows for turn in row["conversations"]] * 20
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    model, processor = build_vision_model("smolvlm-tiny", tokenizer)
    image = Image.open(task.images / "train-00000.png")
    batch = processor(text=["<image>what colour is the circle? red"], images=[[image]], return_tensors="pt")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert int((batch["input_ids"] == image_id).sum()) == 4  # 16 patches, pixel-shuffled by 2
    torch.manual_seed(0)
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert (
        torch.isfinite(loss) and model.model.vision_model.embeddings.patch_embedding.weight.grad is not None
    )
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm")
    again = AutoProcessor.from_pretrained(tmp_path / "vlm")(
        text=["<image>what colour is the circle? red"], images=[[image]], return_tensors="pt"
    )
    assert torch.equal(again["input_ids"], batch["input_ids"])
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, reloaded.eval()(**again).logits)


def test_the_vision_presets_are_the_ones_the_config_layer_names() -> None:
    from lmforge.config.model_kind import VISION_PRESET_NAMES
    from lmforge.models.vision import VISION_PRESETS

    assert tuple(VISION_PRESETS) == VISION_PRESET_NAMES
