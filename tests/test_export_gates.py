"""Quantized exports: GGUF k-quants made by llama.cpp's quantizer (or refused, naming the extra,
where llama-cpp-python is not installed: CI), and `ckpt verify`'s gates on the command line.

The k-quants' numbers on a trained model and a gate they miss: tests/test_gguf_llama_cpp.py
(integration); int8 ONNX missing a gate in an export stage: tests/test_export_stage.py; both
formats passing their gates in the quickstart: tests/test_train_e2e.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.export.runtimes import gguf_precision
from tests.conftest import run_cli, save_tiny_llama

TEXTS = ["the cat sat on the mat and the dog sat on the log\n", "one two three four five six seven\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("gates") / "model")


def test_a_k_quant_is_made_by_llama_cpp_or_refused_naming_the_extra(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q4"
    result = run_cli(
        "ckpt", "convert", str(model_dir), "--to", "gguf", "--dtype", "q4_k_m", "--out", str(out)
    )
    if importlib.util.find_spec("llama_cpp") is None:  # CI: llama.cpp is not compiled there
        assert result.returncode == 2, result.stderr
        assert "--dtype q4_k_m" in result.stderr and "pip install 'lmforge[gguf]'" in result.stderr
        assert "Traceback" not in result.stderr
        assert not out.exists() and not list(tmp_path.glob("q4*"))  # nothing half-written
        return
    assert result.returncode == 0, result.stderr
    assert [f.name for f in out.glob("*.gguf")] == ["model-q4_k_m.gguf"]  # the f16 step is gone
    record = json.loads((out / "lmforge_export.json").read_text())["details"]
    # Rows of 64 are not a multiple of the k-quant block (256): llama.cpp falls back per tensor, as
    # its own tool does, and the conversion says which types it wrote.
    assert record["quantizer"].startswith("llama.cpp") and sum(record["tensor_types"].values()) > 0
    assert gguf_precision(out / "model-q4_k_m.gguf") != "f32"
    assert "llama_model_quantize" not in result.stdout  # llama.cpp's per-tensor lines stay off the console


def test_unknown_quant_type_is_refused_with_the_choices(model_dir: Path, tmp_path: Path) -> None:
    result = run_cli(
        "ckpt", "convert", str(model_dir), "--to", "gguf", "--dtype", "q4_k_x", "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2 and "q4_k_m" in result.stderr and "q6_k" in result.stderr
    assert not (tmp_path / "o").exists()


def test_verify_gates_given_on_the_command_line_decide(model_dir: Path, tmp_path: Path) -> None:
    """An f16 GGUF against its f32 source: the 16-bit defaults pass; a perplexity gate tighter than
    the rounding fails with the number, exit 1."""
    out = tmp_path / "f16"
    assert (
        run_cli(
            "ckpt", "convert", str(model_dir), "--to", "gguf", "--dtype", "f16", "--out", str(out)
        ).returncode
        == 0
    )
    passed = run_cli("ckpt", "verify", str(out), "--json")
    assert passed.returncode == 0, passed.stdout
    verdict = json.loads(passed.stdout)
    assert verdict["precision"] == "f16/bf16" and verdict["tolerances"]["max_ppl_increase"] == 0.01
    increase = verdict["parity"]["ppl_increase"]
    assert abs(increase) < 0.01 and increase != 0.0
    strict = run_cli("ckpt", "verify", str(out), "--max-ppl-increase", "0", "--min-top1-agreement", "1.01")
    assert strict.returncode == 1
    assert "top-1 agreement" in strict.stdout and "needs >= 1.01" in strict.stdout
    if increase > 0:
        assert "perplexity increase" in strict.stdout and "needs <= 0" in strict.stdout


def test_a_gguf_larger_than_the_free_disk_is_refused_before_writing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is the one thing faked here: a filesystem with 10 kB free."""
    import shutil

    from lmforge.errors import UserInputError
    from lmforge.export import to_gguf
    from lmforge.export.convert import convert

    real = shutil.disk_usage
    monkeypatch.setattr(to_gguf.shutil, "disk_usage", lambda path: real(path)._replace(free=10_000))
    with pytest.raises(UserInputError, match=r"the GGUF needs about \d+ MiB and the disk has 0 MiB free"):
        convert(model_dir, "gguf", tmp_path / "out", dtype="f32")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_an_importance_matrix_is_made_by_llama_cpp_tools_or_refused_naming_them(
    model_dir: Path, tmp_path: Path
) -> None:
    import shutil

    data = tmp_path / "calibration.txt"
    data.write_text("".join(TEXTS) * 40)
    out = tmp_path / "q4i"
    args = ["ckpt", "convert", str(model_dir), "--to", "gguf", "--dtype", "q4_k_m", "--out", str(out)]
    result = run_cli(*args, "--imatrix-data", str(data))
    if shutil.which("llama-imatrix") is None or shutil.which("llama-quantize") is None:  # CI
        assert result.returncode == 2, result.stderr
        assert "llama.cpp's tools" in result.stderr and "llama-imatrix" in result.stderr
        assert "cmake --build build --target llama-imatrix llama-quantize" in result.stderr
        assert not out.exists() and not list(tmp_path.glob("q4i*"))
    else:
        assert result.returncode == 0, result.stderr
        details = json.loads((out / "lmforge_export.json").read_text())["details"]
        assert details["quantizer"] == "llama.cpp llama-imatrix + llama-quantize --imatrix"
        assert details["imatrix_chunks"] >= 2 and details["imatrix_data"] == str(data)
    # Whatever is installed: an importance matrix for a type that takes none is refused first.
    f16 = run_cli(*args[:-4], "--dtype", "f16", "--out", str(tmp_path / "f16"), "--imatrix-data", str(data))
    assert f16.returncode == 2 and "goes with a quantized type" in f16.stderr
    onnx = run_cli(
        "ckpt",
        "convert",
        str(model_dir),
        "--to",
        "onnx",
        "--out",
        str(tmp_path / "x"),
        "--imatrix-data",
        str(data),
    )
    assert onnx.returncode == 2 and "for GGUF k-quants, not --to onnx" in onnx.stderr


def test_an_importance_matrix_without_a_k_quant_gguf_export_is_a_config_error() -> None:
    from lmforge.config import load_config
    from lmforge.errors import UserInputError

    config = {
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": "corpus.txt"}]},
        "export": {"formats": ["gguf"], "gguf_dtype": "f16", "gguf_imatrix_data": "eval"},
    }
    with pytest.raises(UserInputError, match=r"export.gguf_imatrix_data: .*not f32/f16/bf16/q8_0"):
        load_config(None, base=config)
    config["export"]["gguf_dtype"] = "q4_k_m"
    load_config(None, base=config)  # the tools and the eval file are the preflight's (machine) checks
