"""What the vision-language examples start from, written offline in about a second: lmforge's shapes
task (rows, images, dpo pairs) and an untrained tiny SmolVLM-architecture model with a tokenizer
trained on the task's text (examples/vlm_sft.yaml, examples/vlm_dpo.yaml; the VLM tests use it too).

    python -m lmforge.pipeline.vlm_starter runs/vlm-start
"""

from __future__ import annotations

from typing import Any

from lmforge.models.vision import build_vision_model, save_vision_model_dir


def write_shapes_starter(out: Any, *, train_rows: int = 1000, eval_rows: int = 64, seed: int = 0) -> None:
    """What the VLM examples start from, written offline: the shapes task under `out`/task (rows,
    images and dpo pairs) and an untrained `smolvlm-tiny` under `out`/model whose tokenizer is
    trained on the task's text. `python -m lmforge.pipeline.vlm_starter OUT` runs it."""
    import json
    from pathlib import Path

    import torch

    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.shapes import write_shapes_pairs, write_shapes_task
    from lmforge.data.tokenizer import train_tokenizer

    root = Path(out)
    task = write_shapes_task(root / "task", train_rows=train_rows, eval_rows=eval_rows, seed=seed)
    write_shapes_pairs(task, seed=seed)
    rows = [json.loads(line) for line in task.train.read_text().splitlines()]
    # Each text five times: BPE's merges then cover the task's words whole.
    texts = [turn["value"] for row in rows for turn in row["conversations"]] * 5
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    torch.manual_seed(seed)
    model, processor = build_vision_model("smolvlm-tiny", tokenizer)
    save_vision_model_dir(root / "model", model, processor)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # --help / -h: the usage, not a folder
        sys.exit(
            "usage: python -m lmforge.pipeline.vlm_starter OUT_DIR  (writes OUT_DIR/task and OUT_DIR/model)"
        )
    write_shapes_starter(sys.argv[1])
    print(f"wrote {sys.argv[1]}/task (shapes rows, images, dpo pairs) and {sys.argv[1]}/model (smolvlm-tiny)")
