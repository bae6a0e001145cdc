"""A vision task lmforge writes itself: coloured shapes on small images, with questions a tiny
vision-language model can learn on a CPU in minutes (issue 39's "a task that learns").

Each image holds shapes (circle, square, triangle) in distinct colours on white; each row asks
one question about it, in LLaMA-Factory's sharegpt layout with an `images` column:

    {"conversations": [{"from": "human", "value": "<image>what colour is the circle?"},
                       {"from": "gpt", "value": "red"}],
     "images": ["images/00012.png"]}

Two kinds of question, half each: the colour of the one shape an image holds (chance: 1 in 4),
and how many shapes, 1 to 3, an image holds (chance: 1 in 3). A text-only guess gets about 0.29;
only a model that reads the pixels gets more (a tiny VLM reaches about 0.6 on a CPU in a minute).
The same seed writes the same files, byte for byte.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("one", "two", "three")


@dataclass(frozen=True)
class ShapesTask:
    """Where `write_shapes_task` put the task: its jsonl files and image folder."""

    train: Path
    eval: Path
    images: Path


def write_shapes_task(
    out: Path, *, train_rows: int = 400, eval_rows: int = 60, size: int = 32, seed: int = 0
) -> ShapesTask:
    """Draw the images and write train.jsonl / eval.jsonl under `out` (paths relative to it)."""
    rng = random.Random(seed)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        lines = []
        for index in range(rows):
            name = f"{split}-{index:05d}.png"
            ask_colour = rng.random() < 0.5
            shapes = _draw(images / name, rng, size, count=1 if ask_colour else rng.randint(1, 3))
            question, answer = _question(shapes, ask_colour)
            lines.append(
                json.dumps(
                    {
                        "conversations": [
                            {"from": "human", "value": f"<image>{question}"},
                            {"from": "gpt", "value": answer},
                        ],
                        "images": [f"images/{name}"],
                    }
                )
            )
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ShapesTask(files["train"], files["eval"], images)


def _draw(path: Path, rng: random.Random, size: int, *, count: int) -> list[tuple[str, str]]:
    """One image of `count` shapes in distinct colours, each in its own cell of a row; the (shape,
    colour) pairs drawn."""
    from PIL import Image, ImageDraw

    shapes = rng.sample(SHAPES, count)
    colours = rng.sample(sorted(COLOURS), count)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size // 3
    cells = rng.sample(range(3), count)
    for shape, colour, column in zip(shapes, colours, cells, strict=True):
        if count == 1:  # a lone shape is drawn large, anywhere: its colour fills several patches
            side = rng.randint(size // 2, size - 4)
            x0, y0 = rng.randint(1, size - side - 1), rng.randint(1, size - side - 1)
            box = (x0, y0, x0 + side, y0 + side)
        else:
            x0 = column * cell + 1
            y0 = rng.randint(1, size - cell - 1)
            box = (x0, y0, x0 + cell - 2, y0 + cell - 2)
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    image.save(path, format="PNG")
    return list(zip(shapes, colours, strict=True))


def _question(shapes: list[tuple[str, str]], ask_colour: bool) -> tuple[str, str]:
    if ask_colour:
        shape, colour = shapes[0]
        return f"what colour is the {shape}?", colour
    return "how many shapes are there?", COUNT_WORDS[len(shapes) - 1]


def shapes_pairs(rows_file: Path, *, seed: int = 0) -> list[dict]:
    """The task's rows as preference pairs (dpo), in LLaMA-Factory's sharegpt layout: the right
    answer chosen, a wrong one of the same kind (another colour, another count) rejected, the
    row's image in the prompt."""
    rng = random.Random(seed)
    pairs = []
    for line in rows_file.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        question, answer = row["conversations"]
        kind = COUNT_WORDS if answer["value"] in COUNT_WORDS else sorted(COLOURS)
        wrong = rng.choice([word for word in kind if word != answer["value"]])
        pairs.append(
            {
                "conversations": [question],
                "chosen": answer,
                "rejected": {"from": "gpt", "value": wrong},
                "images": row["images"],
            }
        )
    return pairs


def write_shapes_pairs(task: ShapesTask, *, seed: int = 0) -> tuple[Path, Path]:
    """pairs-train.jsonl / pairs-eval.jsonl beside the task's files (`shapes_pairs` of each split)."""
    written = []
    for split in (task.train, task.eval):
        out = split.with_name(f"pairs-{split.name}")
        out.write_text(
            "".join(json.dumps(p) + "\n" for p in shapes_pairs(split, seed=seed)), encoding="utf-8"
        )
        written.append(out)
    return written[0], written[1]
