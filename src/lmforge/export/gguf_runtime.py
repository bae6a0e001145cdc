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

import contextlib
import ctypes
from collections.abc import Collection, Iterator, Sequence
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
        return self._greedy_continuation(max_new_tokens, stop_ids)

    def _greedy_continuation(self, max_new_tokens: int, stop_ids: Collection[int]) -> list[int]:
        """Argmax tokens after what the context holds, up to max_new_tokens or a stop id."""
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


class LlamaCppVisionModel(LlamaCppModel):
    """A vision-language GGUF pair in llama.cpp: the text model and its vision projector (mmproj),
    run by llama.cpp's multimodal library (libmtmd) as `llama-mtmd-cli` and `llama-server` run it.

    It takes the reference's token ids with the image files: each image's run of tokens (the
    processor's tiles, overview and frame tokens) must be what libmtmd lays out for that image,
    its own preprocessing of the same file, or the two models would not read the same prompt; the
    text around it is fed as the same ids. Positions that hold image embeddings have no logits in
    llama.cpp: they come back as NaN rows, and verification compares the text positions."""

    takes_images = True
    # llama.cpp's image path is not transformers' to the last bit: on an f32 pair of the tiny test
    # model, each image's features differed from transformers' by 2-3e-4 of their range (tiles that
    # need no resize too, flash attention on or off), the logits after an image by up to 1.7e-4 of
    # theirs, while text before any image agreed to 4e-7 and every mmproj tensor equals the
    # source's. So on rows with images the f32 logit limit (1e-4) is widened to this.
    image_logit_diff_floor = 1e-3

    def __init__(self, path: Path, mmproj: Path, *, n_ctx: int = 2048) -> None:
        super().__init__(path, n_ctx=n_ctx)
        from llama_cpp import mtmd_cpp
        from llama_cpp._logger import llama_log_callback

        self._mtmd_cpp = mtmd_cpp
        # libmtmd logs each image it encodes; through llama-cpp-python's logger (errors only when
        # not verbose) as llama.cpp's own messages go.
        mtmd_cpp.mtmd_log_set(llama_log_callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_helper_log_set(llama_log_callback, ctypes.c_void_p(0))
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = self.llm.n_threads
        self.mtmd = mtmd_cpp.mtmd_init_from_file(str(_check_file(mmproj)).encode(), self.llm.model, params)
        if not self.mtmd:
            raise UserInputError(f"{mmproj}: llama.cpp's multimodal library could not load this projector")
        self.image_token_id = self._single_token("<image>")

    def _single_token(self, text: str) -> int:
        ids = self.llm.tokenize(text.encode(), add_bos=False, special=True)
        if len(ids) != 1:
            raise UserInputError(
                f"{self.path}: the tokenizer has no single {text!r} token; not a VLM's text model"
            )
        return int(ids[0])

    def close(self) -> None:
        if getattr(self, "mtmd", None):
            self._mtmd_cpp.mtmd_free(self.mtmd)
            self.mtmd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone first
            self.close()

    def logits(self, token_ids: list[int], images: Sequence[str] = ()) -> np.ndarray:  # type: ignore[override]
        """Logits [len(token_ids), vocab]; NaN rows where image embeddings sit."""
        self._check_length(len(token_ids))
        rows = np.full((len(token_ids), self.vocab_size), np.nan, dtype=np.float32)
        with self._prompt(token_ids, images) as steps:
            self._reset()
            for text, chunk in steps:
                if chunk is None:
                    start = self.llm.n_tokens
                    self.llm.eval(text)
                    rows[start : self.llm.n_tokens] = self.llm.scores[start : self.llm.n_tokens]
                else:
                    self._eval_image(chunk)
        return rows

    def greedy(  # type: ignore[override]
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        images: Sequence[str] = (),
        *,
        stop_ids: Collection[int] = (),
    ) -> list[int]:
        self._check_length(len(prompt_ids) + max_new_tokens)
        ends_with_text = False
        with self._prompt(prompt_ids, images) as steps:
            self._reset()
            for text, chunk in steps:
                if chunk is None:
                    self.llm.eval(text)
                else:
                    self._eval_image(chunk)
                ends_with_text = chunk is None
        if not ends_with_text:  # llama.cpp computes no logits at an image's embeddings
            raise UserInputError("a prompt ending in an image: verification prompts end with text")
        return self._greedy_continuation(max_new_tokens, stop_ids)

    def _reset(self) -> None:
        """An empty context: image embeddings are decoded outside Llama.eval, which clears the KV
        cache past its position only when it runs."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _eval_image(self, chunk: Any) -> None:
        import llama_cpp

        new_n_past = llama_cpp.llama_pos(0)
        status = self._mtmd_cpp.mtmd_helper_eval_chunk_single(
            self.mtmd,
            self.llm._ctx.ctx,
            chunk,
            llama_cpp.llama_pos(self.llm.n_tokens),
            llama_cpp.llama_seq_id(0),
            self.llm.n_batch,
            False,
            ctypes.byref(new_n_past),
        )
        if status != 0:
            raise RuntimeError(f"llama.cpp could not encode an image (status {status})")
        self.llm.n_tokens = int(new_n_past.value)

    @contextlib.contextmanager
    def _prompt(self, token_ids: list[int], images: Sequence[str]) -> Iterator[list[tuple[list[int], Any]]]:
        """The sequence as steps for llama.cpp, each (text ids, None) or ([], image chunk): each image's
        run of tokens in `token_ids` replaced by libmtmd's chunks for that image file, in order."""
        owned: list[Any] = []
        try:
            steps: list[tuple[list[int], Any]] = []
            rest = list(token_ids)
            for image in images:
                layout, chunks = self._image_layout(image, owned)
                at = _find(rest, layout)
                if at is None:
                    raise UserInputError(
                        f"{image}: llama.cpp lays this image out as {len(layout)} tokens "
                        f"({self._describe(layout)}) and the model's processor laid it out differently; the "
                        "GGUF pair would read another prompt than the model. Fix: export safetensors"
                    )
                if at:
                    steps.append((rest[:at], None))
                steps.extend(chunks)
                rest = rest[at + len(layout) :]
            if rest:
                steps.append((rest, None))
            yield steps
        finally:
            for chunks in owned:
                self._mtmd_cpp.mtmd_input_chunks_free(chunks)

    def _image_layout(self, image: str, owned: list[Any]) -> tuple[list[int], list[tuple[list[int], Any]]]:
        """libmtmd's token layout of one image file (frame tokens as ids, each image embedding as the
        `<image>` id) and its steps."""
        mtmd_cpp = self._mtmd_cpp
        bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_file(self.mtmd, str(image).encode(), False)
        if not bitmap:
            raise UserInputError(f"{image}: llama.cpp could not read this image")
        try:
            text = mtmd_cpp.mtmd_input_text()
            marker = mtmd_cpp.mtmd_default_marker()
            text.text, text.text_len = marker, len(marker)
            text.add_special, text.parse_special = False, True
            chunks = mtmd_cpp.mtmd_input_chunks_init()
            owned.append(chunks)
            bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
            status = mtmd_cpp.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(text), bitmaps, 1)
        finally:
            mtmd_cpp.mtmd_bitmap_free(bitmap)
        if status != 0:
            raise RuntimeError(f"{image}: llama.cpp could not tokenize this image (status {status})")
        layout: list[int] = []
        steps: list[tuple[list[int], Any]] = []
        for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
            if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t()
                pointer = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                ids = [int(pointer[j]) for j in range(count.value)]
                layout += ids
                steps.append((ids, None))
            else:
                layout += [self.image_token_id] * int(mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk))
                steps.append(([], chunk))
        return layout, steps

    def _describe(self, layout: list[int]) -> str:
        images = sum(1 for token in layout if token == self.image_token_id)
        return f"{images} image embeddings and {len(layout) - images} frame tokens"


def _find(sequence: list[int], part: list[int]) -> int | None:
    """Where `part` first occurs in `sequence`, or None."""
    for start in range(len(sequence) - len(part) + 1):
        if sequence[start : start + len(part)] == part:
            return start
    return None
