"""Where a model is pushed or listed from: `--to` / `--registry` text into a typed target.

    DIR                        a local registry directory (DIR/<name>/<version>/)
    mlflow:URI                 an MLflow tracking server or store (mlflow:http://host:5000,
                               mlflow:sqlite:////abs/mlflow.db, mlflow:file:///abs/mlruns; mlflow:
                               alone reads MLFLOW_TRACKING_URI)
    mlflow:DIR                 a local MLflow registry in DIR: a SQLite database DIR/mlflow.db with
                               the artifacts in DIR/artifacts/ (MLflow's own client and UI read it
                               with no setting; MLflow 3's file store needs MLFLOW_ALLOW_FILE_STORE).
                               A DIR that already holds an MLflow file store stays one.
    hf://owner/name            a Hugging Face Hub model repository (push only)

A URI may carry credentials (https://user:password@host): `display` is what lmforge ever prints
or records, with the user part and any query string removed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from lmforge.errors import UserInputError

MLFLOW_PREFIX = "mlflow:"
SQLITE_PREFIX = "sqlite:///"
MLFLOW_DB_NAME = "mlflow.db"  # a local MLflow registry directory's database
ARTIFACTS_DIR = "artifacts"
HUB_PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?")
_FORMS = (
    "a directory, mlflow:DIR, mlflow:URI (mlflow:http://host:5000, mlflow:sqlite:////abs/mlflow.db) "
    "or hf://owner/name"
)


@dataclass(frozen=True)
class LocalTarget:
    root: Path

    @property
    def display(self) -> str:
        return str(self.root)


@dataclass(frozen=True)
class MlflowTarget:
    uri: str  # as given: may hold credentials, never printed or written

    @property
    def display(self) -> str:
        return "mlflow:" + safe_uri(self.uri)

    @property
    def is_file_store(self) -> bool:
        return self.uri.startswith("file:")

    @property
    def database(self) -> Path | None:
        """The SQLite database file of a sqlite: URI (None for any other store, or in-memory)."""
        if not self.uri.startswith(SQLITE_PREFIX) or len(self.uri) == len(SQLITE_PREFIX):
            return None
        return Path(self.uri[len(SQLITE_PREFIX) :].split("?", 1)[0])

    @property
    def artifact_location(self) -> str | None:
        """Where pushes store model files: beside a SQLite database (MLflow's default would be
        ./mlruns under the working directory); elsewhere the store's own default."""
        database = self.database
        return (database.resolve().parent / ARTIFACTS_DIR).as_uri() if database is not None else None


@dataclass(frozen=True)
class HubTarget:
    repo_id: str

    @property
    def display(self) -> str:
        return f"{HUB_PREFIX}{self.repo_id}"


Target = LocalTarget | MlflowTarget | HubTarget


def parse_target(text: str, *, option: str = "--to") -> Target:
    """The target `text` names; a form lmforge does not know is a UserInputError naming the forms."""
    text = text.strip()
    if not text:
        raise UserInputError(f"{option}: empty; pass {_FORMS}")
    if text.startswith(HUB_PREFIX):
        return _hub_target(text[len(HUB_PREFIX) :], option)
    if text.startswith(MLFLOW_PREFIX):
        return MlflowTarget(_mlflow_uri(text[len(MLFLOW_PREFIX) :], option))
    scheme = _SCHEME.match(text)
    # A Windows drive (C:\...) is a path; anything else with a scheme is a target lmforge does not know.
    if scheme and (scheme.group(2) or len(scheme.group(1)) > 1):
        raise UserInputError(
            f"{option} {safe_uri(text)}: unknown target scheme {scheme.group(1)!r}; pass {_FORMS}"
        )
    return LocalTarget(Path(text).expanduser())


def safe_uri(uri: str) -> str:
    """`uri` without its user part (user:password@) and query string (tokens travel there too)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparsable URI>"
    if not parts.netloc:
        return urlunsplit(parts._replace(query="", fragment=""))
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=host, query="", fragment=""))


def _hub_target(repo_id: str, option: str) -> HubTarget:
    repo_id = repo_id.strip("/")
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise UserInputError(
            f"{option} hf://{repo_id}: not a Hub repository id; pass hf://owner/name "
            "(letters, digits, '-', '_', '.')"
        )
    return HubTarget(repo_id)


def _mlflow_uri(rest: str, option: str) -> str:
    if not rest:
        rest = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not rest:
            raise UserInputError(
                f"{option} mlflow: names no tracking URI and MLFLOW_TRACKING_URI is not set; pass "
                "mlflow:DIR (a local registry), mlflow:sqlite:////abs/mlflow.db or mlflow:http://host:5000"
            )
    if rest.startswith("databricks") or (_SCHEME.match(rest) and not re.match(r"^[A-Za-z]:[\\/]", rest)):
        return rest
    directory = Path(rest).expanduser().resolve()
    if _holds_file_store(directory):  # pushed there before the SQLite default: keep reading it
        return directory.as_uri()
    return SQLITE_PREFIX + (directory / MLFLOW_DB_NAME).as_posix()


def _holds_file_store(directory: Path) -> bool:
    """An MLflow file store: experiments as <id>/meta.yaml, registered models under models/."""
    if not directory.is_dir() or (directory / MLFLOW_DB_NAME).exists():
        return False
    return (directory / "models").is_dir() or any(directory.glob("*/meta.yaml"))
