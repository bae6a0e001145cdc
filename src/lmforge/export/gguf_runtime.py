"""Running a GGUF file, for `ckpt verify` and the conversion tests.

Two runtimes with the same two methods:
- `LlamaCppModel`: llama.cpp itself (through llama-cpp-python), what users run the file with
  (Ollama, LM Studio, llama-server). An optional dependency: it compiles llama.cpp on install.
- `TransformersGgufModel`: transformers' GGUF reader, which dequantizes the file into a PyTorch
  model. It checks the file's metadata, tensor names and layout without a compiler (the CI path),
  but it is transformers' reading of the file, not llama.cpp's.

Greedy decoding is the same loop in both (argmax of the last position, no stop token unless given),
so the two can be compared token for token with each other and with the source model.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import UserInputError


def _check_file(path: Path) -> Path:
    path = Path(path)
    if not path.is_file() or path.suffix != ".gguf":
        raise UserInputError(
            f"{path}: not a .gguf file. Fix: point at the file `ckpt convert --to gguf` wrote."
        )
    return path


_GGML_F32 = 0  # ggml_type GGML_TYPE_F32


class LlamaCppModel:
    """A GGUF file loaded in llama.cpp, on CPU, keeping the logits of every evaluated position."""

    def __init__(
        self, path: Path, *, n_ctx: int = 1024, n_threads: int | None = None, f32_kv_cache: bool = True
    ) -> None:
        """n_ctx bounds prompt + generated tokens; the logits buffer is n_ctx x vocab floats.

        llama.cpp keeps its KV cache in f16 by default, which alone moves an f32 model's logits
        by ~1e-4 of their range; verification keeps it in f32 so it measures the file."""
        self.path = _check_file(path)
        self.n_ctx = n_ctx
        try:
            from llama_cpp import Llama
        except ImportError:
            raise UserInputError(
                "running a GGUF in llama.cpp needs llama-cpp-python: `pip install llama-cpp-python` "
                "(builds llama.cpp, several minutes) or `make test-integration`"
            ) from None
        self.llm: Any = Llama(
            model_path=str(self.path),
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            logits_all=True,
            n_threads=n_threads,
            n_gpu_layers=0,
            verbose=False,
            **({"type_k": _GGML_F32, "type_v": _GGML_F32} if f32_kv_cache else {}),  # type: ignore[arg-type]
        )

    @property
    def vocab_size(self) -> int:
        return int(self.llm.n_vocab())

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits [len(token_ids), vocab] for every position of one sequence."""
        self._check_length(len(token_ids))
        self.llm.reset()
        self.llm.eval(list(token_ids))
        return np.array(self.llm.scores[: len(token_ids)], dtype=np.float32)

    def greedy(
        self, prompt_ids: list[int], max_new_tokens: int, *, stop_ids: Collection[int] = ()
    ) -> list[int]:
        """Argmax decoding of up to max_new_tokens after the prompt (stops early only on stop_ids)."""
        self._check_length(len(prompt_ids) + max_new_tokens)
        self.llm.reset()
        self.llm.eval(list(prompt_ids))
        new: list[int] = []
        while len(new) < max_new_tokens:
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            new.append(token)
            if token in stop_ids:
                break
            self.llm.eval([token])
        return new

    def _check_length(self, tokens: int) -> None:
        if tokens > self.n_ctx:
            raise ValueError(
                f"{tokens} tokens do not fit this llama.cpp context of {self.n_ctx}; pass a larger n_ctx"
            )


class TransformersGgufModel:
    """A GGUF file loaded through transformers' GGUF reader (dequantized to float32)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.path = _check_file(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32
        ).eval()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits [len(token_ids), vocab] for every position of one sequence."""
        output = self.model(torch.tensor([list(token_ids)]))
        return output.logits[0].float().numpy()

    @torch.no_grad()
    def greedy(
        self, prompt_ids: list[int], max_new_tokens: int, *, stop_ids: Collection[int] = ()
    ) -> list[int]:
        """Argmax decoding of up to max_new_tokens after the prompt (stops early only on stop_ids)."""
        return greedy_decode(self.model, prompt_ids, max_new_tokens, stop_ids=stop_ids)


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, *, stop_ids: Collection[int] = ()
) -> list[int]:
    """The runtimes' greedy loop for any HF causal LM (with its KV cache), to compare against."""
    new: list[int] = []
    inputs = torch.tensor([list(prompt_ids)])
    past = None
    while len(new) < max_new_tokens:
        output = model(input_ids=inputs, past_key_values=past, use_cache=True)
        past = output.past_key_values
        token = int(output.logits[0, -1].argmax())
        new.append(token)
        if token in stop_ids:
            break
        inputs = torch.tensor([[token]])
    return new
