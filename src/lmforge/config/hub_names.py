"""`model.path` and `tokenizer.path` name a local directory or, when no such directory exists, a
Hugging Face hub id (`name` or `owner/name`). lmforge needs no network: before a hub id is looked up,
whether the hub can be reached at all is checked once, in about a millisecond where there is no
network, instead of transformers' five retries with back-off per file (about 45 s, and two dozen
retry warnings on the console, for a relative path such as `runs/sft/final` that was simply not made
yet). The data stage and the model builder both need it and import neither each other.

Torch-free; huggingface_hub is imported inside the check.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

# A hub id is `name` or `owner/name`; anything else (absolute, ./, ~, three parts) is a local path.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_OFFLINE_VALUES = ("1", "true", "yes", "on")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
# Long enough for a slow but working network to connect, short where it only times out.
PROBE_TIMEOUT_S = 3.0


def is_hub_id(name: str) -> bool:
    """`name` is no local path that exists and reads as a hub id."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


@functools.cache
def hub_unreachable_reason() -> str | None:
    """Why the hub cannot be reached from this process (HF_HUB_OFFLINE set, or no connection to its
    endpoint), or None when it can. Asked once per process."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _OFFLINE_VALUES:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None  # the hub is reached through the proxy, which a direct connection would bypass
    from huggingface_hub import constants

    endpoint = urlsplit(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as err:
        return f"the Hugging Face hub ({host}) cannot be reached ({err.strerror or type(err).__name__})"


def in_hub_cache(name: str) -> bool:
    """A hub model (or tokenizer) downloaded before: its config in the local hub cache, which
    transformers reads without a network."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(name, filename), str):
                return True
        except ValueError:  # not a valid repo id after all (huggingface_hub's HFValidationError)
            return False
    return False


def not_here_and_no_hub(key: str, name: str, fix: str) -> str | None:
    """The error for a `key` naming `name` that is no local directory, when the hub is unreachable
    too (None when `name` exists, is no hub id, is in the local hub cache, or the hub can be reached)."""
    if not is_hub_id(name) or in_hub_cache(name):
        return None
    reason = hub_unreachable_reason()
    if reason is None:
        return None
    where = Path(name).expanduser().absolute()
    return (
        f"{key}: {name!r} is no local directory ({where} does not exist), and as a hub id it cannot be "
        f"looked up: {reason}. Fix: {fix} A hub model: download it where a network exists "
        f"(`hf download {name} --local-dir DIR`) and set {key} to DIR."
    )
