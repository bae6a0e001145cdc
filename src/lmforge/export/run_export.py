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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.config.schema import ExportConfig
from lmforge.errors import ExportVerificationFailed
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
            line = f"export {fmt:12} {artifact['dir']}"
            verdict = artifact.get("verification")
            if verdict and verdict["parity"] and "skipped" not in verdict["parity"]:
                parity = verdict["parity"]
                line += (
                    f"  [{verdict['runtime']}] {'PASS' if verdict['passed'] else 'FAIL'}: top-1 "
                    f"{parity['top1_agreement']:.1%}, ppl {parity['ppl_artifact']:.4g} vs "
                    f"{parity['ppl_reference']:.4g}, greedy {parity['greedy_prefix']:.0%}"
                )
            lines.append(line)
        return lines


def run_export(cfg: ExportConfig, final: Path, export_dir: Path) -> ExportOutcome:
    """Convert (and verify) final/ into export_dir/<format>/ for each configured format.

    Raises ExportVerificationFailed, after writing export.json, when any verification fails."""
    from lmforge.export.verify import verify

    adapter = final / "adapter"
    is_adapter_run = (adapter / "adapter_config.json").is_file()
    source = _full_model(final, adapter, export_dir) if is_adapter_run else final
    reference = adapter if is_adapter_run else final
    dtypes = {"gguf": cfg.gguf_dtype, "onnx": cfg.onnx_dtype, "safetensors": cfg.safetensors_dtype}
    outcome = ExportOutcome(export_dir)
    for fmt in cfg.formats:
        conversion = convert(source, fmt, export_dir / fmt, dtype=dtypes[fmt])
        record: dict[str, Any] = {
            "dir": str(conversion.out),
            "files": [str(f) for f in conversion.files],
            "dtype": dtypes[fmt],
            "details": conversion.details,
        }
        if cfg.verify:
            data = Path(cfg.verify_data) if cfg.verify_data else None
            verdict = verify(conversion.out, against=reference, data=data)
            record["verification"] = verdict.to_json()
            log.info("export %s: verification %s", fmt, "passed" if verdict.passed else "FAILED")
        outcome.artifacts[fmt] = record
    summary = {"source": str(source), "reference": str(reference), "artifacts": outcome.artifacts}
    (export_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    if outcome.failures:
        raise ExportVerificationFailed(
            f"export verification failed ({export_dir / SUMMARY_NAME}): " + "; ".join(outcome.failures)
        )
    return outcome


def _full_model(final: Path, adapter: Path, export_dir: Path) -> Path:
    """final/ when it already holds the merged model (export.merge_lora), else a streaming merge."""
    from lmforge.evaluate.loading import adapter_base, is_full_model

    if is_full_model(final):
        return final
    merged = export_dir / "merged"
    merge_lora(Path(adapter_base(adapter)), adapter, merged)
    return merged
