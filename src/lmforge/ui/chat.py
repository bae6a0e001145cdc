"""Chat with what a run made: its final/ (a full model, or an adapter on its base) in transformers,
as `lmforge generate` runs it; its GGUF export in llama.cpp with the chat template the GGUF
carries, as `lmforge serve` does; or its ONNX export in onnxruntime, with the tokenizer, chat
template and stop tokens exported beside the graph. Replies stream token by token. At most two
models stay loaded (the page's two panes); a model rewritten on disk is loaded again.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from threading import Lock, Thread
from typing import Any

from lmforge.errors import UserInputError
from lmforge.export.runtimes import gguf_file
from lmforge.export.to_onnx import ONNX_NAME, OnnxCausalLM
from lmforge.export.verify import model_fingerprint
from lmforge.ui.runs import RunsRoot

LOADED = 2


class ChatModels:
    def __init__(self, runs: RunsRoot) -> None:
        self.runs = runs
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._lock = Lock()  # one generation at a time: two on two cores only slow each other

    def targets(self) -> list[dict[str, str]]:
        """Every model of every run there is to chat with: `run/final`, `run/gguf`."""
        found = []
        for state in self.runs.runs():
            run_dir = self.runs.run_dir(state.name)
            if _has_model(run_dir / "final"):
                found.append({"id": f"{state.name}/final", "label": f"{state.name} · final (transformers)"})
            gguf_dir = run_dir / "export" / "gguf"
            if gguf_dir.is_dir() and gguf_file(gguf_dir) is not None:
                found.append({"id": f"{state.name}/gguf", "label": f"{state.name} · GGUF export (llama.cpp)"})
            if (run_dir / "export" / "onnx" / ONNX_NAME).is_file():
                found.append(
                    {"id": f"{state.name}/onnx", "label": f"{state.name} · ONNX export (onnxruntime)"}
                )
        return found

    def check(self, target: str, messages: list[dict[str, str]]) -> tuple[Path, str]:
        """The model file or directory and its kind, once the request is known to be answerable
        (before a reply starts streaming, when an error can still be an HTTP status)."""
        _check_messages(messages)
        return self._resolve(target)

    def reply(
        self, target: str, messages: list[dict[str, str]], max_new_tokens: int, temperature: float
    ) -> Iterator[str]:
        """The reply to `messages`, piece by piece as the model writes it."""
        path, kind = self.check(target, messages)
        with self._lock:
            model = self._load(path, kind)
            if kind == "gguf":
                yield from _llama_cpp_reply(model, messages, max_new_tokens, temperature)
            elif kind == "onnx":
                yield from _onnx_reply(model, messages, max_new_tokens, temperature)
            else:
                yield from _transformers_reply(model, messages, max_new_tokens, temperature)

    def _resolve(self, target: str) -> tuple[Path, str]:
        name, _, what = target.partition("/")
        run_dir = self.runs.run_dir(name)  # a name inside the runs root, or UnknownRun
        if what == "final" and _has_model(run_dir / "final"):
            return run_dir / "final", "hf"
        if what == "gguf":
            found = gguf_file(run_dir / "export" / "gguf") if (run_dir / "export" / "gguf").is_dir() else None
            if found is not None:
                if importlib.util.find_spec("llama_cpp") is None:
                    raise UserInputError(
                        "chatting with a GGUF runs llama.cpp, and llama-cpp-python is not installed. Fix: pip "
                        "install 'lmforge[gguf]', or chat with the run's final/"
                    )
                return found, "gguf"
        if what == "onnx" and (run_dir / "export" / "onnx" / ONNX_NAME).is_file():
            return run_dir / "export" / "onnx", "onnx"
        raise UserInputError(
            f"{target}: nothing to chat with there (a run's final/, its GGUF or its ONNX export)"
        )

    def _load(self, path: Path, kind: str) -> Any:
        key = model_fingerprint(path)  # a model rewritten on disk is loaded again
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        if kind == "gguf":
            from llama_cpp import Llama

            model: Any = Llama(model_path=str(path), n_ctx=2048, verbose=False)
        elif kind == "onnx":
            from transformers import AutoTokenizer

            model = (OnnxCausalLM(path), AutoTokenizer.from_pretrained(path))
        else:
            from lmforge.evaluate.loading import load_for_inference

            model = load_for_inference(path)
        self._loaded[key] = model
        while len(self._loaded) > LOADED:
            self._loaded.popitem(last=False)
        return model


def _transformers_reply(
    loaded: Any, messages: list[dict[str, str]], max_new_tokens: int, temperature: float
) -> Iterator[str]:
    from transformers import TextIteratorStreamer

    from lmforge.evaluate.generation import generate_ids

    model, tokenizer = loaded
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = Thread(
        target=generate_ids,
        args=(model, tokenizer, messages),
        kwargs={"max_new_tokens": max_new_tokens, "temperature": temperature, "streamer": streamer},
        daemon=True,
    )
    worker.start()
    yield from streamer
    worker.join()


def _llama_cpp_reply(
    model: Any, messages: list[dict[str, str]], max_new_tokens: int, temperature: float
) -> Iterator[str]:
    for chunk in model.create_chat_completion(
        messages=messages, max_tokens=max_new_tokens, temperature=temperature, stream=True
    ):
        text = chunk["choices"][0]["delta"].get("content")
        if text:
            yield text


def _onnx_reply(
    loaded: Any, messages: list[dict[str, str]], max_new_tokens: int, temperature: float
) -> Iterator[str]:
    """Token by token through the exported graph (no KV cache in it: each token runs the whole
    sequence), greedy at temperature 0, stopping at the template's end of turn as generate() does."""
    import numpy as np

    from lmforge.data.chat import stop_token_ids
    from lmforge.evaluate.generation import render_prompt

    runtime, tokenizer = loaded
    ids = tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
    stops, rng = stop_token_ids(tokenizer), np.random.default_rng()
    new: list[int] = []
    shown = ""
    for _ in range(max_new_tokens):
        logits = runtime.logits([*ids, *new])[-1].astype(np.float64)
        if temperature > 0:
            weights = np.exp((logits - logits.max()) / temperature)
            token = int(rng.choice(len(weights), p=weights / weights.sum()))
        else:
            token = int(logits.argmax())
        if token in stops:
            break
        new.append(token)
        text = tokenizer.decode(new, skip_special_tokens=True)
        if text.startswith(shown) and not text.endswith("\ufffd"):  # a character still incomplete waits
            yield text[len(shown) :]
            shown = text
    rest = tokenizer.decode(new, skip_special_tokens=True)
    if rest.startswith(shown) and rest != shown:
        yield rest[len(shown) :]


def _check_messages(messages: list[dict[str, str]]) -> None:
    roles = ("system", "user", "assistant")
    if not messages or not all(
        isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in messages
    ):
        raise UserInputError("messages: a list of {role: system|user|assistant, content: text}")
    if messages[-1]["role"] != "user":
        raise UserInputError("messages: the last one must be the user's")


def _has_model(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter" / "adapter_config.json").is_file()
