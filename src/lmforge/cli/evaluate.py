"""`lmforge eval` and `lmforge generate`: measure a trained model, or talk to it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from lmforge.cli.console import console
from lmforge.errors import UserInputError


def eval_command(
    target: Path = typer.Argument(
        ..., help="A run's YAML config (evaluates its final/ model) or a model directory."
    ),
    data: list[Path] = typer.Option(
        None,
        "--data",
        help="Text (.txt, jsonl with 'text') or QA jsonl rows to evaluate on (repeatable).",
        show_default=False,
    ),
    scoring: str = typer.Option(
        "exact", "--scoring", help="QA scoring: exact (whitespace-normalised, case-sensitive) or contains."
    ),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest generated answer, in tokens."),
    limit: int = typer.Option(
        None, "--limit", help="Evaluate at most N rows (QA) or blocks (text) per source.", show_default=False
    ),
    tasks: str = typer.Option(
        None,
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated (needs: pip install lm-eval).",
        show_default=False,
    ),
    adapter: Path = typer.Option(
        None, "--adapter", help="PEFT adapter directory to apply on top of the model.", show_default=False
    ),
    columns: str = typer.Option(
        None,
        "--columns",
        help="QA rows' columns when they are not question/answer, alpaca, messages or a known "
        "prompt/response pair, for example question=prompt,answer=response.",
        show_default=False,
    ),
    bertscore_model: str = typer.Option(
        None,
        "--bertscore-model",
        help="Also score QA answers with BERTScore F1 using this encoder (a local model directory; "
        "needs: pip install 'lmforge[bertscore]').",
        show_default=False,
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="Where to write the JSON summary [default: \\<model_dir>/eval.json].",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print only the JSON summary on stdout."),
) -> None:
    """Perplexity, QA accuracy, generation quality (BLEU, chrF, ROUGE-1/2/L, exact match on 0-100)
    and generation samples of a trained model.

    Example: `lmforge eval runs/sft/final --data qa.jsonl --scoring contains --json`
    """
    from lmforge.evaluate.rows import parse_columns
    from lmforge.evaluate.run import EvalRequest, evaluate, json_safe, summary_lines

    if scoring not in ("exact", "contains"):
        raise UserInputError(f"--scoring: {scoring!r} is not one of exact, contains")
    request = EvalRequest(
        target=target,
        data=list(data or []),
        scoring=scoring,  # type: ignore[arg-type]
        max_new_tokens=max_new_tokens,
        limit=limit,
        tasks=[t.strip() for t in (tasks or "").split(",") if t.strip()],
        adapter=adapter,
        columns=parse_columns(columns),
        bertscore_model=bertscore_model,
    )
    model_dir, summary = evaluate(request)
    document = json.dumps(json_safe(summary), indent=2)
    out_path = out or model_dir / "eval.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(document + "\n", encoding="utf-8")
    if as_json:
        sys.stdout.write(document + "\n")
        return
    for line in summary_lines(summary):
        console.print(line, markup=False, highlight=False)
    console.print(f"summary written to {out_path}", markup=False, highlight=False)


def generate(
    model_dir: Path = typer.Argument(..., help="Model directory, adapter directory or a run's final/."),
    prompt: str = typer.Option(..., "--prompt", help="The user message."),
    system: str = typer.Option(None, "--system", help="Optional system message.", show_default=False),
    adapter: Path = typer.Option(
        None, "--adapter", help="PEFT adapter directory to apply on top of the model.", show_default=False
    ),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy."),
    image: list[Path] = typer.Option(
        None,
        "--image",
        help="An image for a vision-language model (repeat for several); placed where the prompt's "
        "\\<image> placeholders are, else before the prompt.",
        show_default=False,
    ),
) -> None:
    """Quick inference with the model's chat template; the reply streams as it is generated.

    Example: `lmforge generate runs/sft/final --prompt 'What is 2 + 3?' --max-new-tokens 32`, or
    with an image: `lmforge generate runs/vlm/final --image cat.png --prompt 'What colour is it?'`
    """
    from lmforge.evaluate.loading import load_for_inference

    if temperature < 0:
        raise UserInputError(
            f"--temperature: {temperature} is negative; use 0 for greedy or a positive value"
        )
    images = _open_images(image or [])
    if images:
        prompt = _with_placeholders(prompt, len(images))
        _require_vision_model(model_dir)
    model, tokenizer = load_for_inference(model_dir, adapter)  # torch loads after the path checks
    from transformers import TextStreamer

    from lmforge.evaluate.generation import chat_messages, generate_ids

    # Prints to stdout as tokens come; skip_special_tokens keeps the end-of-turn token out of it.
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    generate_ids(
        model,
        tokenizer,
        chat_messages(prompt, system),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        streamer=streamer,
        images=images,
        processor=_vision_processor(model_dir, tokenizer) if images else None,
    )  # the streamer ends the reply with a newline


def _open_images(paths: list[Path]) -> list[Any]:
    """--image files, decoded (an unreadable one named before any model loads)."""
    from lmforge.data.images import ImageError, inspect_image

    opened = []
    for path in paths:
        try:
            inspect_image(path)
        except ImageError as err:
            raise UserInputError(f"--image: {err.detail}") from None
        from PIL import Image

        with Image.open(path) as picture:
            opened.append(picture.convert("RGB"))
    return opened


def _with_placeholders(prompt: str, images: int) -> str:
    """The prompt with one <image> placeholder per image: as written, else the images first."""
    from lmforge.data.images import IMAGE_PLACEHOLDER

    written = prompt.count(IMAGE_PLACEHOLDER)
    if written == 0:
        return IMAGE_PLACEHOLDER * images + prompt
    if written != images:
        raise UserInputError(
            f"--prompt has {written} {IMAGE_PLACEHOLDER} placeholder(s) for {images} --image file(s); "
            "write one per image, or none to put the images before the prompt"
        )
    return prompt


def _vision_model_dir(model_dir: Path) -> Path:
    """The folder with the vision-language model's config and processor: `model_dir`, or for a PEFT
    adapter (a LoRA run's final/adapter) the local base model it names."""
    from lmforge.config.model_kind import vision_model_type
    from lmforge.evaluate.loading import adapter_base

    if vision_model_type(model_dir) is None and (model_dir / "adapter_config.json").is_file():
        base = Path(adapter_base(model_dir))
        if vision_model_type(base) is not None:
            return base
    return model_dir


def _require_vision_model(model_dir: Path) -> None:
    from lmforge.config.model_kind import vision_model_type

    if vision_model_type(_vision_model_dir(model_dir)) is None:
        raise UserInputError(
            f"--image: {model_dir} is not a vision-language model folder with its processor (no config.json "
            "with a vision_config), nor an adapter of one; give a VLM run's final/ or its adapter/"
        )


def _vision_processor(model_dir: Path, tokenizer: Any) -> Any:
    """The processor saved beside a vision-language model (a full run's final/, a model folder, or
    an adapter's base model)."""
    from lmforge.data.vision_tokens import load_processor

    return load_processor(str(_vision_model_dir(model_dir)), tokenizer)
