"""What a push returns and what `lmforge registry list|show` print, for every kind of registry."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.registry.lineage import best_metric


@dataclass
class PushResult:
    registry: str  # the target as printed (credentials removed)
    name: str
    version: str  # local / MLflow: 1, 2, ...; Hub: the commit id
    location: str  # where the model is now: a directory, models:/name/version, a Hub URL
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelRow:
    """One registered model: its versions and its latest one's date and metric."""

    name: str
    versions: list[str]
    latest: str
    created: str | None
    metric: str | None
    value: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VersionInfo:
    """One version and its lineage record."""

    registry: str
    name: str
    version: str
    location: str
    created: str | None
    integrity: str  # "ok", or what is wrong with the stored files
    lineage: dict[str, Any] = field(default_factory=dict)
    intact: bool = True  # False: the stored files are not what was pushed (`integrity` says why)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row_for(name: str, versions: list[str], lineage: dict[str, Any] | None, created: str | None) -> ModelRow:
    metric = best_metric(lineage) if lineage else None
    return ModelRow(
        name=name,
        versions=versions,
        latest=versions[-1],
        created=(lineage or {}).get("created") or created,
        metric=metric[0] if metric else None,
        value=metric[1] if metric else None,
    )


def summary_rows(info: VersionInfo) -> list[tuple[str, str]]:
    """`lmforge registry show`: the lineage a person reads first, one (label, text) per line."""
    lineage = info.lineage
    tool = lineage.get("lmforge") or {}
    git = tool.get("git") or {}
    data = lineage.get("data") or {}
    training = lineage.get("training") or {}
    base = lineage.get("base_model") or {}
    files = (lineage.get("model") or {}).get("files") or {}
    rows = [
        ("model", f"{info.name}:{info.version}"),
        ("location", info.location),
        ("integrity", info.integrity),
        ("pushed", str(lineage.get("created") or info.created or "-")),
        ("run", f"{(lineage.get('run') or {}).get('name')} ({(lineage.get('run') or {}).get('dir')})"),
        (
            "lmforge",
            f"{tool.get('trained_with')}, git {git.get('commit') or '-'}"
            + (" (dirty)" if git.get("dirty") else ""),
        ),
        ("training", _training_text(training)),
        ("base model", f"{base.get('name_or_path')} ({base.get('relation')})" if base else "-"),
        ("data", str(data.get("fingerprint"))),
        ("tokenizer", str((lineage.get("tokenizer") or {}).get("fingerprint"))),
    ]
    rows += [("source", str(s.get("path"))) for s in data.get("train_sources") or []]
    evaluation = lineage.get("evaluation") or {}
    if evaluation.get("best"):
        best = evaluation["best"]
        rows.append(("best eval", f"{best['metric']} {best['value']:.4g} at step {best['step']}"))
    for fmt, entry in (lineage.get("exports") or {}).items():
        verdict = "not verified" if not entry.get("verified") else "PASS" if entry.get("passed") else "FAIL"
        rows.append((f"export {fmt}", verdict))
    sealed = (lineage.get("model") or {}).get("sealed")
    if sealed is not None:  # lineage records from before final/ was sealed do not say
        rows.append(("trained files", _SEALED[bool(sealed)]))
    total = sum(int(entry.get("bytes", 0)) for entry in files.values())
    rows.append(("files", f"{len(files)} model files, {total / 2**20:.1f} MiB (sha256 in lineage.json)"))
    return rows


_SEALED = {
    True: "checked against the run's sealed final/ (the hashes training wrote)",
    False: "UNCHECKED: final/ had no hash manifest (pushed with --allow-unsealed)",
}


def _training_text(training: dict[str, Any]) -> str:
    loss = training.get("final_loss")
    loss_text = f", final loss {loss:.4g}" if isinstance(loss, int | float) else ""
    return (
        f"{training.get('stage')} / {training.get('method')}, {training.get('steps')} steps{loss_text}, "
        f"{training.get('status')}"
    )
