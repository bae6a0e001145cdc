"""GGUF k-quants and the other llama.cpp quant types, through llama.cpp's own quantizer.

lmforge writes the f16 GGUF itself (to_gguf.py: weights, tokenizer, chat template), then
`llama_model_quantize` — the function behind llama.cpp's `llama-quantize` tool, exposed by
llama-cpp-python, which is also the runtime GGUFs are verified in — requantizes it into the chosen
type; the metadata (tokenizer, chat template) is carried over by llama.cpp. llama.cpp picks the
type per tensor as its tool does: q4_k_m keeps some tensors at 6 bits, and a tensor whose rows are
not a multiple of the k-quant block (256) falls back to a type that fits (small models), which the
conversion's `tensor_types` shows.

An importance matrix (llama.cpp's `--imatrix`) is not available here: llama-cpp-python exposes
no way to compute one, and the quantizer takes it only as a C++ map.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from lmforge.errors import CheckpointError, UserInputError

log = logging.getLogger(__name__)

# --dtype -> llama.cpp's file type (llama_ftype, LLAMA_FTYPE_MOSTLY_<name>), as llama-quantize names them.
QUANT_TYPES: dict[str, str] = {
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
    "q4_k_m": "Q4_K_M",
    "q4_k_s": "Q4_K_S",
    "q4_0": "Q4_0",
    "q4_1": "Q4_1",
    "q3_k_l": "Q3_K_L",
    "q3_k_m": "Q3_K_M",
    "q3_k_s": "Q3_K_S",
    "q2_k": "Q2_K",
}
INSTALL = "pip install 'lmforge[gguf]' (llama-cpp-python, which compiles llama.cpp: a few minutes)"


def require_quantizer(dtype: str) -> None:
    """UserInputError, before any work, when llama.cpp is not installed to quantize into `dtype`."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserInputError(
            f"--dtype {dtype}: GGUF quantization runs llama.cpp's quantizer, and llama-cpp-python is not "
            f"installed. Fix: {INSTALL}; or choose f32, f16, bf16 or q8_0, which lmforge writes itself"
        )


def quantize(source: Path, target: Path, dtype: str) -> None:
    """Requantize the GGUF `source` (f16/bf16/f32) into `target` as `dtype`, on every core.
    llama.cpp's per-tensor lines go to this module's log (debug), not the console."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{QUANT_TYPES[dtype]}")
    params.nthread = os.cpu_count() or 1
    with _native_output() as captured:
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(target).encode(), ctypes.byref(params)
        )
        output = captured()
    if status != 0:
        tail = "\n".join(output.splitlines()[-5:])
        raise CheckpointError(
            f"llama.cpp could not quantize {source} into {dtype} (status {status}):\n{tail}"
        )
    log.debug("llama.cpp quantize %s -> %s:\n%s", source, target, output)


@contextlib.contextmanager
def _native_output() -> Iterator[Callable[[], str]]:
    """Redirect the process's stdout and stderr file descriptors (C code writes there, past Python's
    sys.stdout) into a temporary file for the duration; yields a function returning what was written."""
    sys.stdout.flush()
    sys.stderr.flush()
    sink = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    start = sink.seek(0, os.SEEK_END)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)

        def captured() -> str:
            sink.flush()
            sink.seek(start)
            return sink.read().decode("utf-8", "replace")

        yield captured
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        sink.close()
