"""Keep secrets out of everything lmforge writes: config dumps, manifests, logs.

A value is secret when its key is named like a credential (token, api_key, secret,
password, ...) or when it equals the value of a credential-looking environment
variable (WANDB_API_KEY, HF_TOKEN, ...), wherever it appears.
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "***REDACTED***"
# Whole name parts (split on _ - . and case) that mark a credential: "hf_token" and
# "WANDB_API_KEY" are secrets, "tokenizer_fingerprint" and "max_new_tokens" are not.
_SECRET_PARTS = {"token", "secret", "password", "passwd", "credential", "credentials", "webhook", "apikey"}
_SECRET_LAST_PART = {"key"}  # OPENAI_KEY, api_key; not key_path
# Special-token names hold vocabulary entries, not credentials.
_SPECIAL_TOKEN_KEYS = {
    "pad_token",
    "eos_token",
    "bos_token",
    "unk_token",
    "sep_token",
    "cls_token",
    "mask_token",
}
_MIN_SECRET_LEN = 6
# Secret values met in a loaded config (a webhook URL in the YAML or in an override): once
# known, they are redacted from free text too (manifest command lines, dry-run output, logs).
_KNOWN_SECRETS: set[str] = set()


def is_secret_key(key: str) -> bool:
    """Whether a config key or environment variable name looks like it holds a credential."""
    if key.lower() in _SPECIAL_TOKEN_KEYS:
        return False
    parts = [p for p in re.split(r"[_\-.]", key.lower()) if p]
    return bool(parts) and (bool(_SECRET_PARTS.intersection(parts)) or parts[-1] in _SECRET_LAST_PART)


def secret_env_values(environ: dict[str, str] | None = None) -> set[str]:
    """Values of environment variables whose names look like credentials, and the secret values
    of every config loaded in this process (see `remember_config_secrets`)."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if is_secret_key(k) and len(v) >= _MIN_SECRET_LEN}
    return found | (_KNOWN_SECRETS if environ is None else set())


def remember_config_secrets(data: Any, key: str = "") -> None:
    """Note the value of every secret-named key in a plain-data config, so that free text that
    repeats it (a command line, an error message) is redacted as well."""
    if isinstance(data, dict):
        for name, value in data.items():
            remember_config_secrets(value, str(name))
    elif isinstance(data, list | tuple):
        for value in data:
            remember_config_secrets(value, key)
    elif isinstance(data, str) and key and is_secret_key(key) and len(data) >= _MIN_SECRET_LEN:
        _KNOWN_SECRETS.add(data)


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the value of every `dotted.secret_key=value` override redacted, and
    known secret values removed from every other word."""
    words = []
    for word in argv:
        name, equals, _ = word.partition("=")
        if equals and is_secret_key(name.rsplit(".", 1)[-1].lstrip("-")):
            words.append(f"{name}={REDACTED}")
        else:
            words.append(redact_text(word))
    return words


def redact(value: Any, *, secrets: set[str] | None = None, key: str = "") -> Any:
    """Return a copy of a JSON-like value with secrets replaced by REDACTED."""
    secrets = secret_env_values() if secrets is None else secrets
    if key and is_secret_key(key) and value not in (None, "", False):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, secrets=secrets, key=str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, secrets=secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, secrets)
    return value


def redact_text(text: str, secrets: set[str] | None = None) -> str:
    """Replace every occurrence of a known secret value inside free text (log lines, messages)."""
    for secret in secrets if secrets is not None else secret_env_values():
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text
