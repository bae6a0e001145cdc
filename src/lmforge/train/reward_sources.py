"""Where rewards come from beyond the built-in rules: a reward model directory and the user's own
Python function, plus reading a completion's text (a string or a list of chat messages).

Both sources are loaded while the trainer is built, so a missing directory, a model without a
scoring head or a module that does not import is a config error before any training."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import UserInputError
from lmforge.verbosity import load_report_to_log

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
RewardFn = Callable[..., list[float]]


def completion_text(completion: Any) -> str:
    """The text of a completion: the string itself, or its messages' content, each tool call the
    model made written as `name(arguments)` (a multi-turn episode's own turns, in order)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(filter(None, (_turn_text(message) for message in completion)))


def answer_text(completion: Any) -> str:
    """What a completion answers: the string itself, or the content of its last message (in a
    tool-use episode, what the model wrote after its last tool call)."""
    if isinstance(completion, str):
        return completion
    return content_text(completion[-1].get("content")) if completion else ""


def _turn_text(message: dict[str, Any]) -> str:
    calls = [call.get("function", call) for call in message.get("tool_calls") or []]
    written = [f"{call.get('name')}({json.dumps(call.get('arguments'))})" for call in calls]
    return "\n".join(filter(None, [content_text(message.get("content")), *written]))


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a multimodal part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


# ---- a reward model --------------------------------------------------------------------------


def model_reward(index: int, path: str, tokenizer: PreTrainedTokenizerBase | None, device: str) -> RewardFn:
    """The score (logits[:, 0]) of a sequence-classification model on prompt + completion."""
    import torch

    model = _load_reward_model(index, path)
    reward_tokenizer = _reward_tokenizer(index, path, tokenizer)
    if len(reward_tokenizer) > model.get_input_embeddings().num_embeddings:
        raise UserInputError(
            f"train.rewards[{index}].path: the tokenizer used with {path!r} has {len(reward_tokenizer)} tokens, "
            f"more than the model's {model.get_input_embeddings().num_embeddings} embeddings. Fix: save the "
            "reward model's own tokenizer into its directory (tokenizer.save_pretrained)"
        )
    # The model pools at the last token that is not its pad id: it must be the id the batch pads with.
    model.config.pad_token_id = reward_tokenizer.pad_token_id
    model.to(device).eval().requires_grad_(False)
    log.info("train.rewards[%d]: reward model %s on %s", index, path, device)

    def reward(*, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        texts = [_render(reward_tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        # As TRL does for its own reward models: the template already holds any special tokens.
        batch = reward_tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(device)
        with torch.inference_mode():
            return [float(x) for x in model(**batch).logits[:, 0].float().tolist()]

    return reward


def _load_reward_model(index: int, path: str) -> Any:
    """A sequence-classification model with a trained one-score head, or a UserInputError."""
    from transformers import AutoModelForSequenceClassification

    key = f"train.rewards[{index}].path"
    fix = (
        "Fix: point it at a reward model directory: the final model of a train.stage rm run, or any HF "
        "sequence-classification model saved with save_pretrained (config.json + model.safetensors)"
    )
    if not Path(path).expanduser().is_dir():
        raise UserInputError(f"{key}: {path!r} is not a directory. {fix}")
    try:
        with load_report_to_log():  # the missing head gets lmforge's own error below
            model, info = AutoModelForSequenceClassification.from_pretrained(
                Path(path).expanduser(),
                use_safetensors=True,
                trust_remote_code=False,
                output_loading_info=True,
            )
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserInputError(
            f"{key}: {path!r} does not load as a sequence-classification model ({reason}). {fix}"
        ) from None
    if info["missing_keys"]:
        # A causal LM loads too, with a new random head: its scores would be noise.
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise UserInputError(
            f"{key}: {path!r} has no trained sequence-classification head ({missing} not in its weights, so "
            f"its scores would be random). {fix}"
        )
    if model.config.num_labels != 1:
        raise UserInputError(
            f"{key}: {path!r} is a classifier with {model.config.num_labels} labels; a reward model gives one "
            f"score (num_labels 1), and its first label's logit is not a reward. {fix}"
        )
    return model


def _reward_tokenizer(index: int, path: str, fallback: PreTrainedTokenizerBase | None) -> Any:
    """The reward model's own tokenizer, else (a copy of) the policy's; either with a pad token."""
    from transformers import AutoTokenizer

    where = Path(path).expanduser()
    tokenizer: PreTrainedTokenizerBase
    if any(
        (where / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserInputError(
                f"train.rewards[{index}].path: the tokenizer in {path!r} does not load ({err})"
            ) from None
    elif fallback is not None:
        log.info("train.rewards[%d]: %s has no tokenizer; it reads text with the policy's", index, path)
        tokenizer = copy.deepcopy(fallback)  # padding settings change below; the policy's stay as they are
    else:
        raise UserInputError(
            f"train.rewards[{index}].path: {path!r} has no tokenizer. Fix: save one into it (tokenizer.save_pretrained)"
        )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserInputError(
                f"train.rewards[{index}].path: the tokenizer of {path!r} has no pad or eos token to pad batches with"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _render(tokenizer: Any, prompt: Any, completion: Any) -> str:
    """Prompt + completion as the reward model reads it: its chat template, else plain text."""
    if isinstance(prompt, str):
        return prompt + completion_text(completion)
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    messages = [*prompt, *completion]
    if tokenizer.chat_template:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(content_text(message.get("content")) for message in messages)


# ---- the user's code ---------------------------------------------------------------------------


def python_reward(index: int, spec: str) -> RewardFn:
    """The user's function `module:function` or `path/file.py:function`, imported now."""
    key = f"train.rewards[{index}].function"
    function = user_object(key, spec)
    if not callable(function):
        raise UserInputError(f"{key}: {spec} is not callable. Fix: name a function defined in its module")
    if inspect.iscoroutinefunction(function):
        raise UserInputError(f"{key}: {spec} is async; a reward function must be a plain (def) function")
    log.warning("train.rewards[%d]: running your code %s (run_user_code: true)", index, spec)
    return function  # type: ignore[no-any-return]


def user_object(key: str, spec: str) -> Any:
    """What `module:name` or `path/file.py:name` names (the user's reward, tool or environment),
    imported now; any failure is a UserInputError naming `key`."""
    source, _, name = spec.rpartition(":")
    module = _import_user_module(key, source)
    found = getattr(module, name, None)
    if found is None:
        raise UserInputError(
            f"{key}: {source} has no {name!r}. Fix: name one defined in it, `{source}:<name>`"
        )
    return found


def _import_user_module(key: str, source: str) -> Any:
    """Import a module by dotted name, or a .py file by path; any failure is a UserInputError."""
    if source.endswith(".py") or "/" in source or "\\" in source:
        path = Path(source).expanduser()
        if not path.is_file():
            raise UserInputError(
                f"{key}: no file {str(path)!r}. Fix: give an existing file, `path/to/file.py:function`"
            )
        module_name = "lmforge_user_" + re.sub(r"\W", "_", f"{key}_{path.stem}")
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise UserInputError(f"{key}: {str(path)!r} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling inside it look the module up here
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise UserInputError(f"{key}: importing {path} failed: {type(err).__name__}: {err}") from None
        return module
    # The `lmforge` console script does not put the working directory on sys.path (python -m does),
    # yet a reward module beside the config is the common case.
    added = str(Path.cwd()) not in sys.path
    if added:
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as err:
        if err.name is not None and (source == err.name or source.startswith(f"{err.name}.")):
            raise UserInputError(
                f"{key}: no module named {source!r}. Fix: run from the directory that holds it, add that "
                "directory to PYTHONPATH, or give the file: `path/to/file.py:function`"
            ) from None
        raise UserInputError(f"{key}: importing {source} failed: ModuleNotFoundError: {err}") from None
    except Exception as err:
        raise UserInputError(f"{key}: importing {source} failed: {type(err).__name__}: {err}") from None
    finally:
        if added:
            sys.path.remove(str(Path.cwd()))


# ---- the one checker -------------------------------------------------------------------------
