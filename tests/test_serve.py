"""`lmforge serve`: a GGUF behind llama-cpp-python's OpenAI-compatible server on 127.0.0.1, asked
with the `openai` client, answers as `lmforge generate` does; what it is given and where it listens
are checked before any model loads. CI has no llama.cpp (it compiles for minutes): there the
missing extra is what is tested; `make test-integration` installs it, and this machine has it."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.serve.server import SERVER_MODULES
from tests.conftest import run_cli, save_tiny_llama

TEXTS = ["the cat sat on the mat and the dog sat on the log\n", "one two three four five six seven\n"]
PROMPTS = ["the cat sat on", "one two three", "where is the dog?"]
HAS_SERVER = all(importlib.util.find_spec(name) is not None for name in SERVER_MODULES)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An HF model directory and its f32 GGUF (lmforge's export: template and stop token inside)."""
    out = tmp_path_factory.mktemp("serve")
    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    hf = save_tiny_llama(tokenizer, out / "model")
    converted = run_cli(
        "ckpt", "convert", str(hf), "--to", "gguf", "--dtype", "f32", "--out", str(out / "gguf")
    )
    assert converted.returncode == 0, converted.stderr
    return hf, out / "gguf"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_served_gguf_answers_like_lmforge_generate(model: tuple[Path, Path]) -> None:
    hf, gguf = model
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "serve", str(gguf), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if not HAS_SERVER:  # CI: the extra is named before any model loads, and nothing listens
            _, stderr = server.communicate(timeout=60)
            assert server.returncode == 2, stderr
            assert "pip install 'lmforge[serve]'" in stderr and "Traceback" not in stderr
            return
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        deadline = time.monotonic() + 60
        while True:
            try:
                served = [m.id for m in client.models.list().data]
                break
            except Exception:
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "the server did not come up in 60 s"
                time.sleep(0.5)
        assert served == ["model"]  # the GGUF's general.name: the model directory's name
        # Something listens there now: a second server on the same port is refused by name.
        busy = run_cli("serve", str(gguf), "--port", str(port))
        assert busy.returncode == 2 and f"--port {port}" in busy.stderr and "in use" in busy.stderr
        for prompt in PROMPTS:
            reply = client.chat.completions.create(
                model="model", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
            )
            expected = run_cli("generate", str(hf), "--prompt", prompt, "--max-new-tokens", "12")
            assert expected.returncode == 0, expected.stderr
            assert reply.choices[0].message.content.strip() == expected.stdout.strip(), prompt
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode in (0, -15)  # SIGTERM: uvicorn shuts down cleanly


def test_what_serve_is_given_is_checked_before_anything_loads(
    model: tuple[Path, Path], tmp_path: Path
) -> None:
    hf, gguf = model
    missing = run_cli("serve", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hi")
    wrong = run_cli("serve", str(not_a_model))
    assert wrong.returncode == 2 and "serve takes a .gguf file" in wrong.stderr
    # An HF directory needs vLLM on a CUDA GPU: refused here with the command that makes a GGUF.
    hf_dir = run_cli("serve", str(hf))
    assert hf_dir.returncode == 2 and "vLLM" in hf_dir.stderr
    assert f"lmforge ckpt convert {hf} --to gguf" in hf_dir.stderr
    for result in (missing, wrong, hf_dir):
        assert "Traceback" not in result.stderr
    if HAS_SERVER:  # a GGUF llama.cpp cannot run is refused naming its architecture
        import gguf as gguf_lib
        import numpy as np

        foreign = tmp_path / "foreign.gguf"
        writer = gguf_lib.GGUFWriter(foreign, "nosucharch")
        writer.add_tensor("x", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        refused = run_cli("serve", str(foreign), "--port", str(free_port()))
        assert refused.returncode == 2 and "architecture nosucharch" in refused.stderr, refused.stderr
