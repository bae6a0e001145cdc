"""The config's `export:` stage: after training, merge -> convert -> verify, into export/.

The trained model is final/ (a full model, or a PEFT adapter in final/adapter/). Adapter runs
are merged first (streaming, export.merge) unless final/ already holds the merged model. Each
format is converted into its own sealed directory and then verified in its own runtime
against the trained model itself — the adapter on its base for adapter runs — so a verdict
covers the whole chain. export/export.json records every artifact and its verdict.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.config.schema import ExportConfig
from lmforge.errors import ExportVerificationFailed, UserInputError
from lmforge.export.convert import convert
from lmforge.export.merge import merge_lora

log = logging.getLogger(__name__)
SUMMARY_NAME = "export.json"


@dataclass
class ExportOutcome:
    export_dir: Path
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def failures(self) -> list[str]:
        return [
            f"{fmt}: {failure}"
            for fmt, artifact in self.artifacts.items()
            for failure in (artifact.get("verification") or {}).get("failures", [])
        ]

    def summary_lines(self) -> list[str]:
        """One line per artifact: where it is and, when verified, the verdict and its key numbers."""
        lines = []
        for fmt, artifact in self.artifacts.items():
            line = f"export {fmt:12} {artifact['dir'] or '(removed: failed its gates)'}"
            verdict = artifact.get("verification")
            if verdict and verdict["parity"] and "skipped" not in verdict["parity"]:
                parity = verdict["parity"]
                line += (
                    f"  [{verdict['runtime']}, {verdict['precision']}] {'PASS' if verdict['passed'] else 'FAIL'}: "
                    f"ppl {parity['ppl_artifact']:.4g} vs {parity['ppl_reference']:.4g} "
                    f"({parity['ppl_increase']:+.1%}), top-1 {parity['top1_agreement']:.1%}"
                )
                if "accuracy" in parity:
                    accuracy = parity["accuracy"]
                    line += f", accuracy {accuracy['artifact']:.0%} vs {accuracy['reference']:.0%}"
                images = verdict.get("images") or {}
                if images:  # a vision-language model: whether its images were fed, and how many
                    line += (
                        f", {images['images']} images fed" if images["checked"] else ", images NOT checked"
                    )
            lines.append(line)
        return lines


def run_export(
    cfg: ExportConfig, final: Path, export_dir: Path, *, held_out: Path | None = None
) -> ExportOutcome:
    """Convert (and verify) final/ into export_dir/<format>/ for each configured format, on
    `cfg.verify_data`, else the run's `held_out` file, else built-in texts.

    Each conversion is verified before it takes its place: one that misses a gate is removed, its
    numbers kept in export.json. Raises ExportVerificationFailed, after writing export.json, when
    any verification fails."""
    adapter = final / "adapter"
    is_adapter_run = (adapter / "adapter_config.json").is_file()
    source = _full_model(final, adapter, export_dir) if is_adapter_run else final
    reference = adapter if is_adapter_run else final
    dtypes = {
        "gguf": cfg.gguf_dtype,
        "onnx": cfg.onnx_dtype,
        "safetensors": cfg.safetensors_dtype,
        "compressed-tensors": cfg.compressed_dtype,
        "tensorrt-llm": None,  # bf16, what TensorRT-LLM runs
    }
    data = Path(cfg.verify_data) if cfg.verify_data else held_out
    outcome = ExportOutcome(export_dir)
    for fmt in cfg.formats:
        out = export_dir / fmt
        record: dict[str, Any] = {"dir": str(out), "dtype": dtypes[fmt]}
        check = _Gate(cfg, reference, data, out) if cfg.verify else None
        try:
            conversion = convert(
                source, fmt, out, dtype=dtypes[fmt], imatrix_data=_imatrix_data(cfg, fmt, data), accept=check
            )
        except _Rejected:
            shutil.rmtree(out, ignore_errors=True)  # an earlier export of this run is no longer its export
            record["dir"] = None
        else:
            record |= {"files": [str(f) for f in conversion.files], "details": conversion.details}
        if check is not None and check.verdict is not None:
            record["verification"] = check.verdict
            log.info("export %s: verification %s", fmt, "passed" if check.verdict["passed"] else "FAILED")
        outcome.artifacts[fmt] = record
    summary = {"source": str(source), "reference": str(reference), "artifacts": outcome.artifacts}
    (export_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    if outcome.failures:
        raise ExportVerificationFailed(
            f"export verification failed, the failing exports removed ({export_dir / SUMMARY_NAME}): "
            + "; ".join(outcome.failures)
        )
    return outcome


def _imatrix_data(cfg: ExportConfig, fmt: str, verify_data: Path | None) -> Path | None:
    """The GGUF importance matrix's calibration file: `eval` is the verify data."""
    if fmt != "gguf" or cfg.gguf_imatrix_data is None:
        return None
    if cfg.gguf_imatrix_data != "eval":
        return Path(cfg.gguf_imatrix_data)
    if verify_data is None:
        raise UserInputError(
            "export.gguf_imatrix_data: eval, and the run has no eval data to calibrate on. Fix: set "
            "export.verify_data, data.eval, or a file here"
        )
    return verify_data


class _Rejected(Exception):
    """A conversion that missed a gate (its verdict is on the _Gate)."""


class _Gate:
    """convert()'s `accept`: verify the finished conversion against the trained model before it
    takes its place, refusing it when a gate or parity check fails."""

    def __init__(self, cfg: ExportConfig, reference: Path, data: Path | None, out: Path) -> None:
        self.reference, self.data, self.out = reference, data, out
        self.limits = {k: v for k, v in cfg.gates.model_dump().items() if v is not None}
        self.verdict: dict[str, Any] | None = None

    def __call__(self, staging: Path) -> None:
        from lmforge.export.verify import verify

        verdict = verify(staging, against=self.reference, data=self.data, tolerances=self.limits)
        self.verdict = verdict.to_json() | {"path": str(self.out)}
        if not verdict.passed:
            raise _Rejected(staging)


def _full_model(final: Path, adapter: Path, export_dir: Path) -> Path:
    """final/ when it already holds the merged model (export.merge_lora), else a streaming merge."""
    from lmforge.evaluate.loading import adapter_base, is_full_model

    if is_full_model(final):
        return final
    merged = export_dir / "merged"
    merge_lora(Path(adapter_base(adapter)), adapter, merged)
    return merged
