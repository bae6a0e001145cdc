"""GGUF k-quants and the other llama.cpp quant types, through llama.cpp's own quantizer.

lmforge writes the f16 GGUF itself (to_gguf.py: weights, tokenizer, chat template), then
`llama_model_quantize` — the function behind llama.cpp's `llama-quantize` tool, exposed by
llama-cpp-python, which is also the runtime GGUFs are verified in — requantizes it into the chosen
type; the metadata (tokenizer, chat template) is carried over by llama.cpp. llama.cpp picks the
type per tensor as its tool does: q4_k_m keeps some tensors at 6 bits, and a tensor whose rows are
not a multiple of the k-quant block (256) falls back to a type that fits (small models), which the
conversion's `tensor_types` shows.

With an importance matrix (`export.gguf_imatrix`, `ckpt convert --imatrix-data`), llama.cpp's own
tools do both steps, as its users run them: `llama-imatrix` measures which weights matter on the
calibration texts (the run's held-out data, chat-rendered like verification reads it) and
`llama-quantize --imatrix` spends the bits there. llama-cpp-python cannot: it has no imatrix
computation and its quantizer takes the matrix only as a C++ map. The tools come with llama.cpp
(a package manager's llama.cpp, or a build of its `llama-imatrix` and `llama-quantize` targets).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import subprocess
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
IMATRIX_TOOLS = ("llama-imatrix", "llama-quantize")
TOOLS_INSTALL = (
    "install llama.cpp (for example `brew install llama.cpp`), or build its tools: `cmake -S llama.cpp -B build "
    "&& cmake --build build --target llama-imatrix llama-quantize`, and put build/bin on PATH"
)
_MIN_CONTEXT, _MAX_CONTEXT = 32, 512  # llama-imatrix reads the text in chunks of one context each


def require_quantizer(dtype: str) -> None:
    """UserInputError, before any work, when llama.cpp is not installed to quantize into `dtype`."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserInputError(
            f"--dtype {dtype}: GGUF quantization runs llama.cpp's quantizer, and llama-cpp-python is not "
            f"installed. Fix: {INSTALL}; or choose f32, f16, bf16 or q8_0, which lmforge writes itself"
        )


def require_imatrix_tools(dtype: str) -> dict[str, str]:
    """The paths of llama.cpp's llama-imatrix and llama-quantize; UserInputError, before any work,
    naming what is missing, when `dtype` is no llama.cpp quant type or a tool is not on PATH."""
    if dtype not in QUANT_TYPES:
        raise UserInputError(
            f"--dtype {dtype}: an importance matrix steers llama.cpp's quantizer, so it goes with a quantized "
            f"type ({', '.join(QUANT_TYPES)}); f32/f16/bf16/q8_0 take none"
        )
    tools = {name: shutil.which(name) for name in IMATRIX_TOOLS}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise UserInputError(
            f"an importance matrix is computed and applied by llama.cpp's tools, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on PATH. Fix: {TOOLS_INSTALL}; or quantize without one"
        )
    return {name: str(path) for name, path in tools.items()}


def quantize_with_imatrix(
    source: Path, target: Path, dtype: str, calibration: list[str], tokens: int, tools: dict[str, str]
) -> dict[str, object]:
    """Quantize the f16 GGUF `source` into `target` with an importance matrix llama.cpp computes on
    the `calibration` texts (`tokens` long in the model's tokenizer). Returns what was used."""
    context = _context_for(tokens)
    threads = str(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="lmforge-imatrix-") as work:
        text, matrix = Path(work) / "calibration.txt", Path(work) / "imatrix.gguf"
        text.write_text("\n".join(calibration))
        _run_tool(
            [
                tools["llama-imatrix"],
                "-m",
                str(source),
                "-f",
                str(text),
                "-o",
                str(matrix),
                "-c",
                str(context),
            ]
            + ["--no-ppl", "-t", threads],
            what="compute the importance matrix",
        )
        _run_tool(
            [
                tools["llama-quantize"],
                "--imatrix",
                str(matrix),
                str(source),
                str(target),
                QUANT_TYPES[dtype],
                threads,
            ],
            what=f"quantize into {dtype}",
        )
    return {"imatrix_tokens": tokens, "imatrix_context": context, "imatrix_chunks": tokens // context}


def _context_for(tokens: int) -> int:
    """The largest power-of-two context (32..512) that leaves llama-imatrix at least two chunks."""
    context = _MAX_CONTEXT
    while context > _MIN_CONTEXT and tokens < 2 * context:
        context //= 2
    if tokens < 2 * context:
        raise UserInputError(
            f"the calibration data holds {tokens} tokens; an importance matrix needs at least {2 * _MIN_CONTEXT}. "
            "Fix: more held-out rows (export.verify_data / --imatrix-data), or quantize without one"
        )
    return context


def _run_tool(command: list[str], *, what: str) -> None:
    """Run a llama.cpp tool with its output in the log (debug); CheckpointError with its last lines."""
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    output = (result.stdout + result.stderr).strip()
    log.debug("%s:\n%s", " ".join(command), output)
    if result.returncode != 0:
        tail = "\n".join(output.splitlines()[-5:])
        raise CheckpointError(
            f"llama.cpp could not {what} ({Path(command[0]).name} exit {result.returncode}):\n{tail}"
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
