"""The registry as the UI shows it: `lmforge registry list` and `show` (with `--verify` on request),
and each version's model card. Read-only; the registry is the one `lmforge ui --registry` names (a
local directory by default, `registry`, as for `lmforge push` and `lmforge registry`, or mlflow:URI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError

CARD_NAME = "README.md"  # the model card a push writes beside the model


class RegistryView:
    def __init__(self, registry: str | Path) -> None:
        self.registry = str(registry)
        self.local = not self.registry.startswith("mlflow:")

    def models(self) -> dict[str, Any]:
        """Every registered model (name, versions, the latest one's date and best eval metric)."""
        from lmforge.registry import list_models

        if self.local and not Path(self.registry).is_dir():
            note = (
                f"no registry at {self.registry} yet: `lmforge push RUN_DIR --to {self.registry}` makes one"
            )
            return {"registry": self.registry, "models": [], "note": note}
        rows = [row.to_json() for row in list_models(self.registry)]
        return {"registry": self.registry, "models": rows, "note": ""}

    def version(self, name: str, version: str, *, verify: bool) -> dict[str, Any]:
        """One version: its lineage as `registry show` prints it, the integrity of its files (every
        file re-hashed when `verify`), the export verdicts and the model card."""
        from lmforge.registry import show_version, summary_rows

        if version != "latest" and not version.isdigit():
            raise UserInputError(f"version {version!r}: a number, or latest")
        info = show_version(self.registry, name, None if version == "latest" else version, verify=verify)
        return {
            **info.to_json(),
            "summary": summary_rows(info),
            "exports": info.lineage.get("exports") or {},
            "card": self._card(Path(info.location)) if self.local else "",
        }

    def _card(self, location: Path) -> str:
        card = location / CARD_NAME
        inside = card.resolve().is_relative_to(Path(self.registry).resolve())
        return card.read_text(encoding="utf-8") if inside and card.is_file() else ""
