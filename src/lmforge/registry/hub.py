"""The Hugging Face Hub: `hf://owner/name` gets the pushed folder (model, README.md, lineage.json)
as one commit.

Needs a network and a token from the environment (HF_TOKEN, or HUGGING_FACE_HUB_TOKEN): the token
goes to the Hub client in memory only, is never written to a file, and is searched for in every
staged file before anything is uploaded. A new repository is private unless asked otherwise.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.errors import UserInputError, WorkFailed
from lmforge.registry.bundle import finish_bundle, stage_model
from lmforge.registry.lineage import LineageFor, ModelFiles, hash_files
from lmforge.registry.records import PushResult
from lmforge.registry.targets import HubTarget

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def hub_token() -> str:
    """The Hub token from the environment; UserInputError naming the variables when there is none."""
    for variable in TOKEN_VARIABLES:
        token = os.environ.get(variable, "").strip()
        if token:
            return token
    raise UserInputError(
        "pushing to the Hugging Face Hub needs a write token in the environment: set HF_TOKEN (or "
        "HUGGING_FACE_HUB_TOKEN); lmforge reads it from there only and never writes it anywhere"
    )


def push_hub(
    model: ModelFiles,
    lineage_for: LineageFor,
    target: HubTarget,
    *,
    private: bool = True,
    extra_secrets: tuple[str, ...] = (),
) -> PushResult:
    """Upload the pushed folder to `target` in one commit; create the repository when it is new."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise UserInputError(
            f"{target.display}: HF_HUB_OFFLINE is set; the Hub needs a network (unset it to push)"
        )
    token = hub_token()
    with tempfile.TemporaryDirectory(prefix="lmforge-push-") as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        stage_model(model, folder, link=True)
        hashes = hash_files({n: folder / n for n in model.files})
        lineage = lineage_for(hashes, {"registry": "hub", "repo_id": target.repo_id})
        finish_bundle(folder, lineage, load_from=target.repo_id, extra_secrets=(token, *extra_secrets))
        commit = _upload(folder, target, token, private=private, message=_message(lineage))
    return PushResult(
        registry=target.display,
        name=target.repo_id,
        version=str(commit.oid),
        location=str(commit.commit_url),
        files=len(hashes),
        bytes=sum(int(entry["bytes"]) for entry in hashes.values()),
    )


def _upload(folder: Path, target: HubTarget, token: str, *, private: bool, message: str) -> CommitInfo:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        api.create_repo(target.repo_id, repo_type="model", private=private, exist_ok=True)
        return api.upload_folder(repo_id=target.repo_id, folder_path=folder, commit_message=message)
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        if status in (401, 403):
            raise UserInputError(
                f"{target.display}: the Hub refused the token (HTTP {status}); set HF_TOKEN to a token with "
                "write access to that repository"
            ) from None
        raise WorkFailed(f"{target.display}: the Hub answered HTTP {status}: {first_line}") from None
    except Exception as err:  # the HTTP client's connection and timeout errors: no traceback, say where
        raise WorkFailed(
            f"{target.display}: cannot reach the Hub at {constants.ENDPOINT} ({type(err).__name__}: {err}); "
            "check the network (and HF_ENDPOINT), then push again"
        ) from None


def _message(lineage: dict[str, object]) -> str:
    run = lineage.get("run")
    name = run.get("name") if isinstance(run, dict) else None
    return f"lmforge push of run {name}"
