"""The lineage record of a finished run: what produced the model, as one JSON document.

    lineage = build_lineage(load_run(run_dir), model, name="my-model")

Code (lmforge version, git commit, packages), the resolved config (secrets redacted), the data
(fingerprint, sources, what the data stage produced), the tokenizer fingerprint, the base model
(the adapter's base, or the model fine-tuned from), the training summary, the eval results, the
export verdicts with their artifacts' hashes, and the sha256 of every file of the model itself.
Everything comes from the run directory; nothing is recomputed but the model files' hashes. The
registry writes it as lineage.json beside the model; W&B / MLflow artifact logging can reuse it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

import lmforge
from lmforge.ckpt.atomic import MANIFEST_NAME, MARKER_NAME, sha256_file
from lmforge.config.redact import redact
from lmforge.errors import UserInputError
from lmforge.evaluate.loading import adapter_base, is_full_model
from lmforge.report.load import RunSummary, is_run_dir
from lmforge.run_layout import FINISHED_NAME, RunPaths, read_finished, read_json_object

LINEAGE_NAME = "lineage.json"
LINEAGE_SCHEMA = "lmforge.lineage/1"
# final/ entries that are records of the run, not parts of the model (PEFT's README.md is a blank
# template card that the registry's own model card replaces; final/'s seal is checked, not pushed).
_NOT_MODEL = {FINISHED_NAME, "README.md", "training_args.bin", MANIFEST_NAME, MARKER_NAME}
# Builds a lineage record once the pushed copies are hashed: (hashes, push record) -> lineage.
LineageFor = Callable[[dict[str, dict[str, Any]], dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class ModelFiles:
    """What of final/ is pushed: each file's path in final/ and its name in the pushed model."""

    library: str  # "transformers" (a full HF model) or "peft" (an adapter only)
    files: dict[str, Path]  # pushed name -> source file

    @property
    def is_adapter(self) -> bool:
        return self.library == "peft"


def model_files(run_dir: Path) -> ModelFiles:
    """The model of a finished run: final/ itself when it is a full model (with final/adapter/ when
    the run also kept its adapter), else the PEFT adapter of final/adapter/ at the top, so that
    `from_pretrained(pushed)` loads it either way. UserInputError for a run without a complete final/."""
    paths = RunPaths(run_dir)
    if not is_run_dir(run_dir):
        raise UserInputError(
            f"{run_dir}: not a run directory (no config.yaml with metrics.jsonl or manifest.json); pass "
            "runs/<name> as written by `lmforge train`"
        )
    if read_finished(paths) is None:
        raise UserInputError(
            f"{run_dir}: no complete final/ (the run has not finished, or final/ was removed); let the run "
            "finish (`lmforge train CONFIG` resumes it) and push again"
        )
    adapter = paths.final / "adapter"
    if is_full_model(paths.final):
        return ModelFiles("transformers", _files_under(paths.final))
    if (adapter / "adapter_config.json").is_file():
        return ModelFiles("peft", _files_under(adapter))
    raise UserInputError(
        f"{paths.final}: neither an HF model (config.json with *.safetensors) nor a PEFT adapter "
        "(adapter/adapter_config.json); nothing to push"
    )


def hash_files(files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """{pushed name: {sha256, bytes}} for every file."""
    return {name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for name, p in sorted(files.items())}


def build_lineage(
    run: RunSummary,
    model: ModelFiles,
    hashes: dict[str, dict[str, Any]],
    *,
    name: str,
    push: dict[str, Any] | None = None,
    sealed: bool = True,
) -> dict[str, Any]:
    """The lineage record of `run`, whose model files (`model`, hashed as `hashes`) are pushed as
    `name` (`push`: where to, without URIs); `sealed`: the hashes were checked against final/'s
    hash manifest. Secrets (by key name and by value) are redacted from every string in it."""
    manifest = run.manifest
    config = _config_data(run)
    finished = read_finished(RunPaths(run.root)) or {}
    record = {
        "schema": LINEAGE_SCHEMA,
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "lmforge": {
            "trained_with": (manifest.get("packages") or {}).get("lmforge"),
            "pushed_with": lmforge.__version__,
            "git": manifest.get("git"),
        },
        "run": {"name": run.name, "dir": str(run.root.resolve()), "started": manifest.get("created")},
        "environment": {
            key: manifest.get(key) for key in ("packages", "python", "hardware", "distributed", "command")
        },
        "config": config,
        "data": _data(run, config),
        "tokenizer": _tokenizer(run, config),
        "base_model": _base_model(run, model),
        "model": {
            "library": model.library,
            "adapter": model.is_adapter,
            "parameters": finished.get("parameters"),
            "sealed": sealed,
            "files": hashes,
        },
        "training": _training(run, finished),
        "evaluation": _evaluation(run),
        "exports": _exports(run),
        "push": push or {},
    }
    return redact(record)


def read_lineage(path: Path) -> dict[str, Any]:
    """A lineage.json; UserInputError when it is missing or not a lineage record."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserInputError(f"{path}: unreadable lineage record: {err}") from None
    if not isinstance(record, dict) or record.get("schema") != LINEAGE_SCHEMA:
        raise UserInputError(f"{path}: not an lmforge lineage record (schema {LINEAGE_SCHEMA})")
    return record


def best_metric(lineage: dict[str, Any]) -> tuple[str, float] | None:
    """(metric, value) the registry lists a version by: the best eval, else the final training loss."""
    best = (lineage.get("evaluation") or {}).get("best")
    if best:
        return str(best["metric"]), float(best["value"])
    loss = (lineage.get("training") or {}).get("final_loss")
    return ("loss", float(loss)) if isinstance(loss, int | float) else None


def _files_under(directory: Path) -> dict[str, Path]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory)
        if rel.name in _NOT_MODEL or rel.name.endswith(".partial"):
            continue
        files[rel.as_posix()] = path
    return files


def _config_data(run: RunSummary) -> dict[str, Any]:
    """config.yaml as written (secrets redacted): the record of the run, not the schema's reading of it."""
    try:
        data = yaml.safe_load(run.config_text) if run.config_text else None
    except yaml.YAMLError:
        data = None
    return redact(data) if isinstance(data, dict) else run.config.as_dict()


def _sources(config: dict[str, Any], split: str) -> list[dict[str, Any]]:
    listed = (config.get("data") or {}).get(split) or []
    keys = ("path", "format", "dataset", "weight", "max_documents")
    return [{k: s.get(k) for k in keys if s.get(k) is not None} for s in listed if isinstance(s, dict)]


def _data(run: RunSummary, config: dict[str, Any]) -> dict[str, Any]:
    report = run.data_report or {}
    summary = {
        split: {k: v for k, v in report[split].items() if isinstance(v, int | float | str)}
        for split in ("train", "eval", "rows")
        if isinstance(report.get(split), dict)
    }
    return {
        "fingerprint": run.manifest.get("data_fingerprint") or report.get("fingerprint"),
        "train_sources": _sources(config, "train"),
        "eval_sources": _sources(config, "eval"),
        "eval_from": report.get("eval_from"),
        "max_length": (config.get("data") or {}).get("max_length"),
        "summary": summary,
    }


def _tokenizer(run: RunSummary, config: dict[str, Any]) -> dict[str, Any]:
    section = config.get("tokenizer") or {}
    model_path = (config.get("model") or {}).get("path")
    source = section.get("path") or ("trained for this run" if section.get("train") else model_path)
    return {"fingerprint": run.manifest.get("tokenizer_fingerprint"), "source": source}


def _base_model(run: RunSummary, model: ModelFiles) -> dict[str, Any] | None:
    """The adapter's base (PEFT records it), or the model a full fine-tune started from; when that is
    another lmforge run's final/, that run's identity too (its own lineage is one push away)."""
    adapter = RunPaths(run.root).final / "adapter"
    if (adapter / "adapter_config.json").is_file():
        relation = (
            "adapter base" if model.is_adapter else "adapter base (the adapter is merged into this model)"
        )
        name_or_path = adapter_base(adapter)
    elif run.config.model is not None and run.config.model.path:
        name_or_path, relation = run.config.model.path, "fine-tuned from"
    else:
        return None
    base: dict[str, Any] = {"name_or_path": name_or_path, "relation": relation, "run": None}
    local = Path(name_or_path)
    if local.name == "final" and is_run_dir(local.parent):
        manifest = read_json_object(RunPaths(local.parent).manifest)
        base["run"] = {
            "dir": str(local.parent.resolve()),
            "git": manifest.get("git"),
            "data_fingerprint": manifest.get("data_fingerprint"),
            "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"),
        }
    if local.is_dir() and (local / "config.json").is_file():
        base["config_sha256"] = sha256_file(local / "config.json")
    return base


def _training(run: RunSummary, finished: dict[str, Any]) -> dict[str, Any]:
    loss = run.last_finite("loss")
    tokens = run.last_finite("tokens_seen")
    kinds: dict[str, int] = {}
    for event in run.events:
        kinds[str(event.get("kind"))] = kinds.get(str(event.get("kind")), 0) + 1
    return {
        "stage": run.stage,
        "method": run.config.train.method,
        "status": run.status,
        "steps": finished.get("step", run.last_step),
        "target": finished.get("target"),
        "final_loss": loss[1] if loss else None,
        "tokens_seen": int(tokens[1]) if tokens else None,
        "duration_s": run.duration_s,
        "events": kinds,
    }


def _evaluation(run: RunSummary) -> dict[str, Any]:
    best = run.best_eval()
    last = {}
    for key in sorted(k for k in run.series if k.startswith("eval_")):
        found = run.last_finite(key)
        if found is not None:
            last[key] = {"step": found[0], "value": found[1]}
    return {
        "best": {"metric": best[0], "value": best[1], "step": best[2]} if best else None,
        "last": last,
    }


def _exports(run: RunSummary) -> dict[str, Any]:
    """Each export's verdict and key numbers, and its files' hashes from its sealed hash manifest."""
    exports: dict[str, Any] = {}
    for fmt, artifact in ((run.export or {}).get("artifacts") or {}).items():
        verdict = artifact.get("verification") or {}
        parity = verdict.get("parity") or {}
        sealed = read_json_object(Path(str(artifact.get("dir", ""))) / MANIFEST_NAME).get("files") or {}
        exports[fmt] = {
            "dtype": artifact.get("dtype"),
            "verified": bool(verdict),
            "passed": verdict.get("passed"),
            "runtime": verdict.get("runtime"),
            "failures": verdict.get("failures", []),
            "precision": verdict.get("precision"),
            "top1_agreement": parity.get("top1_agreement"),
            "ppl_rel_diff": parity.get("ppl_rel_diff"),
            "ppl_increase": parity.get("ppl_increase"),
            "accuracy": (parity.get("accuracy") or {}).get("artifact"),
            "accuracy_drop": (parity.get("accuracy") or {}).get("drop"),
            "greedy_prefix": parity.get("greedy_prefix"),
            "files": {name: entry.get("sha256") for name, entry in sealed.items()},
        }
    return exports
