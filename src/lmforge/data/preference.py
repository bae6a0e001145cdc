"""Preference data (dpo, rm), labelled data (kto) and RL prompts (grpo, rloo): rows -> validated,
length-checked TRL datasets.

The data stage does what TRL does not: reads every lmforge format and source, applies the
bad-row policy, applies `over_length` with counts, reports lengths, duplicates and
eval overlap, and caches the result under a fingerprint. It hands TRL the conversational
form TRL's trainers tokenize themselves with the tokenizer's chat template
(`prompt` / `chosen` / `rejected`, `prompt` / `completion` / `label` for KTO, or `prompt` /
`answer` for online RL, where the answer is the reference the rewards compare with), so the
tokens TRL trains on are the ones `apply_chat_template` renders, as in SFT. The order of
the steps is `data.prep`'s; this module supplies the preference kind's parts.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from datasets import Dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.config.stages import stage_spec
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.chat import Dropped, TokenizedSample, adopt_template, tokenize_conversations
from lmforge.data.chat_render import message_dicts
from lmforge.data.examples import (
    Conversation,
    Example,
    LabeledConversation,
    Message,
    Origin,
    PreferencePair,
)
from lmforge.data.formats import valid_examples
from lmforge.data.prep import prepare, split_holdout
from lmforge.data.sft import sft_fingerprint
from lmforge.data.stats import length_histogram
from lmforge.errors import UserInputError
from lmforge.verbosity import datasets_bars_off, progress_bar

if TYPE_CHECKING:
    from lmforge.data.vision_tokens import ImageTokens

CODE_VERSION = "preference-v2"
_CHUNK = 512
# The stages whose rows may hold images: TRL's DPOTrainer feeds a vision-language model the
# pixels with the prompt; the others' trainers take text only.
IMAGE_STAGES = ("dpo",)
# (prompt, answers, kto label, (origin, tools, prompt images)): one length-checked unit of a row.
_Unit = tuple[list[Message], list[Message], bool | None, tuple[Origin, Any, list[str]]]


@dataclass
class PreparedPreference:
    """Checked preference / KTO rows per split, in the form TRL tokenizes, with the data report."""

    train: Dataset
    eval: Dataset | None
    fingerprint: str
    report: dict[str, Any]


def prepare_preference_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    stage: str,
    *,
    seed: int,
    cache_dir: Path,
    quarantine_path: Path,
    image_tokens: ImageTokens | None = None,
) -> PreparedPreference:
    """Read, validate and length-check preference or KTO rows; cached under a fingerprint.

    The tokenizer carries the template the data was checked with (`adopt_template`), so
    TRL's tokenization, `final/` and `lmforge generate` all use that template. A vision-language
    model's `image_tokens` count each prompt image's tokens in the lengths (dpo rows may hold
    images; each row keeps its image paths in an `images` column).
    """
    kind = _PreferenceKind(cfg, tokenizer, stage, seed, quarantine_path, image_tokens)
    prepared = prepare(kind, cfg, seed=seed, cache_dir=cache_dir)
    train, evaluation = prepared.data
    return PreparedPreference(train, evaluation, prepared.fingerprint, prepared.report)


class _PreferenceKind:
    """Preference / KTO rows as a `DataKind` of `data.prep`: splits are checked rows in memory."""

    unit: str = "row"

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        stage: str,
        seed: int,
        quarantine_path: Path,
        image_tokens: ImageTokens | None,
    ) -> None:
        self.cfg, self.tokenizer, self.stage, self.seed = cfg, tokenizer, stage, seed
        self.template = adopt_template(tokenizer, cfg.chat_template)
        self.image_tokens = image_tokens
        self.bad_rows: BadRowPolicy | None = BadRowPolicy(
            cfg.on_bad_row, cfg.max_bad_fraction, quarantine_path
        )
        self.checker = _LengthChecker(cfg, tokenizer, self.template, image_tokens)
        self.meta: dict[str, Any] = {}
        self.timings: dict[str, float] = {}

    def fingerprint(self) -> str:
        sft = sft_fingerprint(self.cfg, self.tokenizer, self.template, self.seed)
        images = self.image_tokens.fingerprint() if self.image_tokens is not None else "text"
        return hashlib.sha256(f"{CODE_VERSION}:{self.stage}:{sft}:{images}".encode()).hexdigest()

    def cache_name(self, fingerprint: str) -> str:
        return f"{self.stage}-{fingerprint}"

    def load(self, path: Path, report: dict[str, Any]) -> tuple[Dataset, Dataset | None]:
        evaluation = load_from_disk(str(path / "eval")) if (path / "eval").is_dir() else None
        return load_from_disk(str(path / "train")), evaluation

    def read_split(self, sources: Sequence[SourceConfig], split: str, workdir: Path) -> list[_Row]:
        assert self.bad_rows is not None
        examples = valid_examples(
            sources, self.bad_rows, memory_budget_mb=self.cfg.memory_budget_mb, seed=self.seed
        )
        return self.checker.rows(examples, self.stage, split)

    def size(self, data: list[_Row]) -> int:
        return len(data)

    def hold_out(
        self, train: list[_Row], eval_fraction: float, seed: int, workdir: Path
    ) -> tuple[list[_Row], list[_Row]]:
        too_few = f"data.eval_fraction={eval_fraction}: holding out eval rows needs at least 2 rows"
        train_rows, eval_rows = split_holdout(len(train), eval_fraction, seed, too_few=too_few)
        return [train[i] for i in train_rows], [train[i] for i in eval_rows]

    def save(self, train: list[_Row], evaluation: list[_Row] | None, workdir: Path) -> None:
        with_images = any("images" in row.record for row in [*train, *(evaluation or [])])
        _save_quietly(_records(train, with_images), workdir / "train")
        if evaluation:
            _save_quietly(_records(evaluation, with_images), workdir / "eval")

    def report(self, train: list[_Row], evaluation: list[_Row] | None) -> dict[str, Any]:
        assert self.bad_rows is not None
        train_keys = {row.key for row in train}
        return {
            "stage": self.stage,
            "rows": self.bad_rows.counts(),
            "dropped": dict(self.checker.dropped),
            "train": _split_report(train),
            "eval": _split_report(evaluation) if evaluation else {"rows": 0},
            "exact_duplicates_in_train": len(train) - len(train_keys),
            "eval_rows_also_in_train": sum(row.key in train_keys for row in evaluation or []),
            "chat_template": self.cfg.chat_template or "tokenizer",
        }


def _save_quietly(dataset: Dataset, path: Path) -> None:
    """`save_to_disk` without datasets' "Saving the dataset (1/1 shards)" bar: the console shows
    lmforge's own progress for the data stage, and that bar drew two lines per split on it."""
    with datasets_bars_off():
        dataset.save_to_disk(str(path))


def _records(rows: list[_Row], with_images: bool) -> Dataset:
    """The rows' TRL records as a dataset; when any row has images every row gets the column (a
    text-only pair an empty list), since a dataset's columns come from its first row."""
    if with_images:
        return Dataset.from_list([{"images": [], **row.record} for row in rows])
    return Dataset.from_list([row.record for row in rows])


@dataclass
class _Row:
    """One TRL row with what the report needs: token lengths and a content key for duplicates."""

    record: dict[str, Any]
    prompt_tokens: int
    answer_tokens: list[int]  # chosen and rejected (dpo/rm) or the completion (kto)
    key: str
    label: bool | None = None


class _LengthChecker:
    """Tokenizes each answer with its prompt exactly as training will, to apply `over_length`."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        image_tokens: ImageTokens | None,
    ) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        self.image_tokens = image_tokens
        self.dropped: Counter[str] = Counter()

    def rows(self, examples: Iterable[Example], stage: str, split: str) -> list[_Row]:
        out: list[_Row] = []
        chunk: list[_Unit] = []
        with progress_bar(desc=f"check lengths {split}", unit="row") as bar:
            for example in examples:
                chunk.extend(_as_prompt_and_answers(example, stage))
                bar.update(1)
                if len(chunk) >= _CHUNK:
                    out.extend(self._check(chunk, stage, split))
                    chunk = []
            out.extend(self._check(chunk, stage, split))
        return out

    def _check(
        self,
        chunk: Sequence[_Unit],
        stage: str,
        split: str,
    ) -> list[_Row]:
        if not chunk:
            return []
        conversations = [
            Conversation([*prompt, answer], origin, tools, images=images)
            for prompt, answers, _, (origin, tools, images) in chunk
            for answer in answers
        ]
        results = iter(
            tokenize_conversations(
                conversations,
                self.tokenizer,
                template=self.template,
                train_on="last_assistant",
                max_length=self.cfg.max_length,
                over_length=self.cfg.over_length,
                image_tokens=self.image_tokens,
            )
        )
        rows = []
        for prompt, answers, label, (_, tools, images) in chunk:
            samples = [next(results) for _ in answers]
            dropped = [s for s in samples if isinstance(s, Dropped)]
            if dropped:
                self.dropped[f"{split}: {dropped[0].reason}"] += 1
                continue
            rows.append(_row(prompt, answers, label, tools, images, samples, stage))  # type: ignore[arg-type]
        return rows


def _as_prompt_and_answers(example: Example, stage: str) -> list[_Unit]:
    """(prompt, answers, kto label, (origin, tools)) units; KTO reads a pair as one good and one bad row."""
    kind = stage_spec(stage).data_kind
    if example.images and stage not in IMAGE_STAGES:
        raise UserInputError(
            f"{example.origin.file}:{example.origin.line}: the row has images, but train.stage: {stage} "
            f"trains on text only; images are trained by sft and {', '.join(IMAGE_STAGES)}. Fix: use one of "
            "those stages, or remove the images column and the <image> placeholders"
        )
    if isinstance(example, PreferencePair):
        meta = (example.origin, example.tools, example.images)
        if kind == "labelled":
            return [
                (example.prompt, [example.chosen], True, meta),
                (example.prompt, [example.rejected], False, meta),
            ]
        return [(example.prompt, [example.chosen, example.rejected], None, meta)]
    if isinstance(example, LabeledConversation) and kind == "labelled":
        meta = (example.origin, None, example.images)
        return [(example.messages[:-1], [example.messages[-1]], example.label, meta)]
    if kind == "prompts":
        # A prompt and its reference answer: the conversation's last assistant turn, or the chosen
        # answer of a preference pair.
        if isinstance(example, Conversation):
            meta = (example.origin, example.tools, example.images)
            return [(example.messages[:-1], [example.messages[-1]], None, meta)]
        if isinstance(example, PreferencePair):
            return [(example.prompt, [example.chosen], None, (example.origin, example.tools, []))]
    wanted = (
        "kto rows or preference pairs"
        if kind == "labelled"
        else "preference pairs (prompt, chosen, rejected)"
    )
    raise UserInputError(
        f"{example.origin.file}:{example.origin.line}: a {type(example).__name__} row, but train.stage: "
        f"{stage} needs {wanted}; set the source's format"
    )


def _row(
    prompt: list[Message],
    answers: list[Message],
    label: bool | None,
    tools: Any,
    images: list[str],
    samples: list[TokenizedSample],
    stage: str,
) -> _Row:
    prompt_dicts = message_dicts(prompt)
    answer_dicts = [message_dicts([a]) for a in answers]
    kind = stage_spec(stage).data_kind
    if kind == "labelled":
        record: dict[str, Any] = {"prompt": prompt_dicts, "completion": answer_dicts[0], "label": bool(label)}
    elif kind == "prompts":
        record = {"prompt": prompt_dicts, "answer": answers[0].content}
    else:
        record = {"prompt": prompt_dicts, "chosen": answer_dicts[0], "rejected": answer_dicts[1]}
    if tools:
        record["tools"] = json.dumps(tools)
    if images:
        record["images"] = images
    supervised = [int((s.labels != -100).sum()) for s in samples]
    prompt_tokens = len(samples[0].input_ids) - supervised[0]
    key = hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=16).hexdigest()
    return _Row(record, prompt_tokens, supervised, key, label)


def _split_report(rows: list[_Row]) -> dict[str, Any]:
    prompt = np.array([r.prompt_tokens for r in rows])
    answers = np.array([n for r in rows for n in r.answer_tokens])
    report: dict[str, Any] = {
        "rows": len(rows),
        "prompt_tokens_p50": float(np.percentile(prompt, 50)),
        "prompt_tokens_max": int(prompt.max()),
        "answer_tokens_p50": float(np.percentile(answers, 50)),
        "answer_tokens_p90": float(np.percentile(answers, 90)),
        "answer_tokens_max": int(answers.max()),
        # What the model runs: the prompt followed by each answer.
        "length_histogram": length_histogram(
            np.array([r.prompt_tokens + n for r in rows for n in r.answer_tokens])
        ),
    }
    images = [len(r.record.get("images", [])) for r in rows]
    if any(images):
        report["images"] = sum(images)
        report["rows_with_images"] = sum(count > 0 for count in images)
    labels = [r.label for r in rows if r.label is not None]
    if labels:
        report["desirable"] = sum(labels)
        report["undesirable"] = len(labels) - sum(labels)
    return report


def rendered_image_pairs(dataset: Dataset, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """dpo rows with images in the form TRL's vision collator takes: the prompt rendered by the
    run's chat template (its `<image>` placeholders left for the processor to expand, the same
    expansion the length check counted), each answer as the text the template adds after it, and
    the image paths (the processor opens them). `reference` keeps the chosen answer's text, what
    eval generations score against."""

    def render(row: dict[str, Any]) -> dict[str, str]:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        prompt = str(
            tokenizer.apply_chat_template(
                row["prompt"], tools=tools, tokenize=False, add_generation_prompt=True
            )
        )
        answers = {}
        for column in ("chosen", "rejected"):
            whole = str(
                tokenizer.apply_chat_template(row["prompt"] + row[column], tools=tools, tokenize=False)
            )
            if not whole.startswith(prompt):
                raise UserInputError(
                    "the chat template renders a prompt differently alone and before its answer, so the "
                    "answer's text cannot be cut from it; set data.chat_template to a catalogue template"
                )
            answers[column] = whole[len(prompt) :]
        return {"prompt": prompt, **answers, "reference": row["chosen"][-1]["content"]}

    return dataset.map(render, desc="render image pairs")
