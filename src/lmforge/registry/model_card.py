"""The model card (README.md in the Hugging Face model-card format) of a pushed model.

YAML front matter that the Hub and `huggingface_hub.ModelCard` read (library_name, base_model when
it is a Hub id, license when the base model declares one, tags, and an `lmforge` block with the
fingerprints), then a body a person reads: training, data, evaluation, exports, how to load it.
Everything in it comes from the lineage record, whose strings are already redacted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from lmforge.config.hub_names import is_hub_id
from lmforge.registry.lineage import LINEAGE_NAME

_MLFLOW_URI = re.compile(r"^(runs|models):/")


def render_model_card(lineage: dict[str, Any], *, load_from: str) -> str:
    """README.md text for the model `lineage` describes; `load_from` is what `from_pretrained` takes
    to load it where it is pushed (a directory, a Hub repo id)."""
    data = card_data(lineage)
    sections = [
        f"# {lineage['name']}",
        _intro(lineage),
        _training(lineage),
        _data(lineage),
        _evaluation(lineage),
        _exports(lineage),
        _usage(lineage, load_from),
    ]
    body = "\n\n".join(s for s in sections if s)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n"))


def card_data(lineage: dict[str, Any]) -> ModelCardData:
    """The front matter: what the Hub indexes the model by."""
    training = lineage.get("training") or {}
    base = (lineage.get("base_model") or {}).get("name_or_path")
    adapter = bool((lineage.get("model") or {}).get("adapter"))
    tags = ["lmforge", str(training.get("stage")), str(training.get("method"))]
    return ModelCardData(
        model_name=lineage["name"],
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        base_model=base if _is_hub_id(base) else None,
        license=_base_license(base),
        tags=tags,
        lmforge={
            "run": (lineage.get("run") or {}).get("name"),
            "data_fingerprint": (lineage.get("data") or {}).get("fingerprint"),
            "tokenizer_fingerprint": (lineage.get("tokenizer") or {}).get("fingerprint"),
            "git_commit": ((lineage.get("lmforge") or {}).get("git") or {}).get("commit"),
            "lineage": LINEAGE_NAME,
        },
    )


def _is_hub_id(name: Any) -> bool:
    """A Hub model id (owner/name), not a local path: only those are valid `base_model` metadata."""
    return isinstance(name, str) and is_hub_id(name)


def _base_license(base: Any) -> str | None:
    """The license a local base model's own model card declares (a fine-tune inherits it)."""
    if not isinstance(base, str) or not (Path(base) / "README.md").is_file():
        return None
    try:
        license_name = ModelCard.load(Path(base) / "README.md").data.to_dict().get("license")
    except Exception:  # a base's malformed card must not stop the push; the license is then unknown
        return None
    return license_name if isinstance(license_name, str) else None


def _intro(lineage: dict[str, Any]) -> str:
    tool = lineage.get("lmforge") or {}
    git = tool.get("git") or {}
    commit = f"git commit `{git.get('commit')}`" + (" (with uncommitted changes)" if git.get("dirty") else "")
    return (
        f"Trained by lmforge {tool.get('trained_with') or '?'} in run `{(lineage.get('run') or {}).get('name')}`"
        f" ({commit if git.get('commit') else 'no git commit recorded'}). `{LINEAGE_NAME}` beside this card "
        "is the full machine-readable record: the resolved config (secrets redacted), data and tokenizer "
        "fingerprints, training summary, evaluations, export verdicts and the sha256 of every file."
    )


def _training(lineage: dict[str, Any]) -> str:
    training = lineage.get("training") or {}
    target = training.get("target") or {}
    base = lineage.get("base_model") or {}
    rows = [
        ("stage / method", f"{training.get('stage')} / {training.get('method')}"),
        (
            "steps",
            f"{training.get('steps')}" + (f" of {target['max_steps']}" if target.get("max_steps") else ""),
        ),
        ("final training loss", _number(training.get("final_loss"))),
        ("tokens seen", _number(training.get("tokens_seen"))),
        ("duration", _duration(training.get("duration_s"))),
        ("status", training.get("status")),
        ("parameters", _number((lineage.get("model") or {}).get("parameters"))),
    ]
    if base:
        rows.append((base.get("relation", "base model"), f"`{base.get('name_or_path')}`"))
    return "## Training\n\n" + _table(("", ""), rows)


def _data(lineage: dict[str, Any]) -> str:
    data = lineage.get("data") or {}
    lines = [
        "## Data",
        "",
        f"- data fingerprint: `{data.get('fingerprint')}`",
        f"- tokenizer fingerprint: `{(lineage.get('tokenizer') or {}).get('fingerprint')}` "
        f"({(lineage.get('tokenizer') or {}).get('source')})",
        f"- max length: {data.get('max_length')} tokens",
    ]
    for split in ("train", "eval"):
        for source in data.get(f"{split}_sources") or []:
            extras = ", ".join(f"{k} {v}" for k, v in source.items() if k != "path")
            lines.append(f"- {split} source: `{source.get('path')}`" + (f" ({extras})" if extras else ""))
    if data.get("eval_from"):
        lines.append(f"- evaluation data: {data['eval_from'].replace('_', ' ')}")
    train = (data.get("summary") or {}).get("train") or {}
    counts = ", ".join(f"{k} {_number(v)}" for k, v in train.items() if isinstance(v, int | float))
    if counts:
        lines.append(f"- training split: {counts}")
    return "\n".join(lines)


def _evaluation(lineage: dict[str, Any]) -> str:
    evaluation = lineage.get("evaluation") or {}
    rows = []
    best = evaluation.get("best")
    if best:
        rows.append((f"{best['metric']} (best)", _number(best["value"]), best.get("step")))
    for key, entry in (evaluation.get("last") or {}).items():
        rows.append((f"{key} (last)", _number(entry["value"]), entry["step"]))
    if not rows:
        return "## Evaluation\n\nNo evaluation was recorded in this run."
    return "## Evaluation\n\n" + _table(("metric", "value", "step"), rows)


def _exports(lineage: dict[str, Any]) -> str:
    exports = lineage.get("exports") or {}
    if not exports:
        return ""
    rows = []
    for fmt, entry in exports.items():
        verdict = "not verified" if not entry.get("verified") else ("PASS" if entry.get("passed") else "FAIL")
        rows.append(
            (
                f"{fmt} ({entry.get('dtype') or 'as trained'})",
                verdict,
                entry.get("runtime") or "-",
                _signed_percent(entry.get("ppl_increase")),
                _percent(entry.get("top1_agreement")),
                _percent(entry.get("accuracy")),
                _signed_percent(entry.get("accuracy_drop")),
                "; ".join(entry.get("failures") or []) or "-",
            )
        )
    headers = (
        "format",
        "verdict",
        "runtime",
        "perplexity increase",
        "top-1 agreement",
        "accuracy",
        "accuracy drop",
        "failures",
    )
    return "## Exports\n\nEach export was run in its own runtime against the trained model.\n\n" + _table(
        headers, rows
    )


def _usage(lineage: dict[str, Any], load_from: str) -> str:
    model = lineage.get("model") or {}
    lines = ["from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if _MLFLOW_URI.match(load_from):  # an MLflow artifact: download it, then load the folder
        lines[:0] = ["import mlflow"]
        lines += [f"path = mlflow.artifacts.download_artifacts({load_from!r})"]
        where = "path"
    else:
        where = repr(load_from)
    if model.get("adapter"):
        base = (lineage.get("base_model") or {}).get("name_or_path")
        lines[:0] = ["from peft import PeftModel"]
        lines += [
            f"base = AutoModelForCausalLM.from_pretrained({base!r})",
            f"model = PeftModel.from_pretrained(base, {where})",
        ]
    else:
        lines += [f"model = AutoModelForCausalLM.from_pretrained({where})"]
    lines += [f"tokenizer = AutoTokenizer.from_pretrained({where})"]
    code = "\n".join(lines)
    return f"## How to use\n\n```python\n{code}\n```"


def _table(headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.4g}"


def _percent(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def _signed_percent(value: Any) -> str:
    return f"{value:+.1%}" if isinstance(value, int | float) else "-"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
