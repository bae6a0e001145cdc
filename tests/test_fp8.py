"""train.precision fp8 (train/fp8.py): the refusals before any work, torchao's float8 conversion of a
tiny Llama on CPU (which layers, which stay bf16), float8 training next to bf16, and a converted
model saving the same plain tensors as an unconverted one.

torch 2.13 runs torch._scaled_mm on CPUs, so Float8Linear's forward and backward run here too; a real
run stays refused on CPU (float8 pays on GPUs of compute capability 8.9+ only)."""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.config import load_config
from lmforge.config.schema import Fp8Config, TrainConfig
from lmforge.errors import UserInputError
from lmforge.train import preflight
from lmforge.train.fp8 import Float8ScalesCallback, convert_linears_to_float8, refuse_fp8_plan
from lmforge.train.precision import autocast_precision, require_fp8_device, resolve_precision
from tests.conftest import ROOT, run_cli
from tests.test_bad_input import assert_user_error, write_config

pytest.importorskip("torchao")  # the fp8 extra (in dev, so CI runs these)

# Widths that are multiples of 16 except the MLP's (120): its three layers stay in bf16.
ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def tiny_llama(**arch: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**ARCH, **arch}))


def linear_kinds(model: torch.nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_fp8_on_a_cpu_machine_is_refused_before_any_work(tmp_path: Path, corpus: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path, corpus, precision="fp8")))
    assert_user_error(result, "train.precision=fp8", "compute capability 8.9", "train.precision: bf16")
    assert not (tmp_path / "runs").exists()  # refused before the run directory, tokenizer or data


def test_a_gpu_without_float8_matmuls_is_refused_naming_its_capability() -> None:
    with pytest.raises(
        UserInputError, match=r"train.precision=fp8 .* is 8\.0\. Fix: set train.precision: bf16"
    ):
        require_fp8_device(use_cuda=True, capability=(8, 0))
    require_fp8_device(use_cuda=True, capability=(8, 9))  # Ada: L4, L40S, RTX 4090
    require_fp8_device(use_cuda=True, capability=(9, 0))  # Hopper
    with pytest.raises(UserInputError, match="no CUDA GPU"):
        resolve_precision("fp8", use_cuda=False)
    assert autocast_precision("fp8") == "bf16" and autocast_precision("fp16") == "fp16"


def test_a_missing_torchao_is_refused_with_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "require_fp8_device", lambda **_: None)  # as on an H100
    found = preflight.importlib.util.find_spec
    monkeypatch.setattr(
        preflight.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else found(name, *a)
    )
    with pytest.raises(UserInputError, match=r"pip install 'lmforge\[fp8\]'"):
        preflight.check_precision_runs_here(TrainConfig(precision="fp8"))


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"train": {"method": "lora"}}, "fp8 trains full weights"),
        ({"train": {"method": "freeze"}}, "fp8 trains full weights"),
        ({"distributed": {"strategy": "deepspeed"}}, "not inside DeepSpeed's engine"),
        ({"distributed": {"strategy": "fsdp", "tensor_parallel": 2}}, "torchao's own float8 parallel styles"),
    ],
)
def test_combinations_fp8_cannot_run_are_refused_when_the_config_loads(
    settings: dict[str, Any], words: str
) -> None:
    base: dict[str, Any] = {
        "model": {"preset": "llama-tiny", **settings.get("model", {})},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": "x.txt"}]},
        "train": {"precision": "fp8", **settings.get("train", {})},
        "distributed": settings.get("distributed", {}),
    }
    with pytest.raises(UserInputError) as info:
        load_config(None, base=base)
    assert "train.precision: " in str(info.value) and words in str(info.value)


def test_engines_a_worker_resolved_are_refused_too() -> None:
    with pytest.raises(UserInputError, match="distributed.strategy: fsdp"):
        refuse_fp8_plan("deepspeed", tensor_parallel=1)
    with pytest.raises(UserInputError, match="tensor_parallel: 2"):
        refuse_fp8_plan("fsdp", tensor_parallel=2)
    refuse_fp8_plan("fsdp", tensor_parallel=1)
    refuse_fp8_plan("ddp", tensor_parallel=1)


def test_accelerate_launch_may_say_bf16_for_fp8_but_not_its_own_fp8() -> None:
    from lmforge.distributed.accelerate_launch import accelerate_choice, check_precision

    for given in ("bf16", "no"):
        choice = accelerate_choice({"ACCELERATE_MIXED_PRECISION": given})
        assert choice is not None
        check_precision(choice, "fp8")
    choice = accelerate_choice({"ACCELERATE_MIXED_PRECISION": "fp8"})
    assert choice is not None
    with pytest.raises(UserInputError, match="accelerate's own float8 backend"):
        check_precision(choice, "fp8")


def test_fp8_configs_are_estimated_and_planned_without_a_gpu() -> None:
    config = ROOT / "examples" / "fp8_pretrain.yaml"
    estimate = run_cli("estimate", str(config), "--gpus", "8", "--gpu-mem", "80GB")
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    dry = run_cli("launch", str(config), "--nproc-per-node", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-2000:]


def test_fp8_trains_under_bf16_autocast(tmp_path: Path) -> None:
    from lmforge.run_layout import RunPaths
    from lmforge.train.arguments import build_training_arguments
    from lmforge.train.numerics import PRECISION_DTYPES

    args = build_training_arguments(
        TrainConfig(precision="fp8", max_steps=1), RunPaths(tmp_path), seed=0, has_eval=False, precision="fp8"
    )
    assert args.bf16 and not args.fp16
    assert PRECISION_DTYPES["fp8"] == torch.bfloat16  # MFU against the bf16 peak (CPU: the bf16 matmul)


def test_torchaos_import_notices_stay_off_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers imports torchao in every command once the fp8 extra is installed; on a machine
    without torchao's CUDA kernels it named each one it could not load, and torch warned about its enums."""
    from lmforge.verbosity import VERBOSE_ENV

    script = "import lmforge.cli\nimport transformers.modeling_utils\nimport torchao.float8\n"
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    quiet = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "Failed to load" not in quiet.stderr and "Enum subclass" not in quiet.stderr, quiet.stderr[-2000:]
    loud = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**env, VERBOSE_ENV: "1"},
        timeout=300,
    )
    assert "Enum subclass" in loud.stderr  # --verbose shows them


# -- the conversion --------------------------------------------------------------------------------


def test_conversion_keeps_the_head_excluded_names_and_odd_sizes_in_bf16(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = tiny_llama(intermediate_size=120)
    settings = Fp8Config(exclude=["lm_head", "layers.1.self_attn.o_proj"])
    with caplog.at_level(logging.INFO, logger="lmforge.train.fp8"):
        converted = convert_linears_to_float8(model, settings, fsdp=False)
    kinds = linear_kinds(model)
    assert sorted(converted) == sorted(name for name, kind in kinds.items() if kind == "Float8Linear")
    assert sorted(converted) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo" if (i, p) != (1, "o")
    )
    for name in ("lm_head", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        assert kinds[name] == "Linear", name
    assert caplog.records[-1].getMessage() == (
        "fp8 (tensorwise): 7 linear layers in float8, kept in bf16: model.layers.1.self_attn.o_proj "
        "(train.fp8.exclude), lm_head (train.fp8.exclude), model.layers.*.mlp.gate_proj x2 (64x120, not "
        "multiples of 16), model.layers.*.mlp.up_proj x2 (64x120, not multiples of 16), "
        "model.layers.*.mlp.down_proj x2 (120x64, not multiples of 16); MFU is measured against the bf16 peak"
    )


def test_a_head_tied_to_the_embeddings_stays_bf16_even_when_not_excluded() -> None:
    model = tiny_llama(tie_word_embeddings=True)
    convert_linears_to_float8(model, Fp8Config(recipe="rowwise", exclude=[]), fsdp=False)
    assert linear_kinds(model)["lm_head"] == "Linear"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert linear_kinds(model)["model.layers.0.mlp.up_proj"] == "Float8Linear"


def test_fsdp_all_gathers_float8_weights_only_with_the_tensorwise_recipe() -> None:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for recipe, all_gather in (("tensorwise", True), ("rowwise", False)):
        model = tiny_llama()
        convert_linears_to_float8(model, Fp8Config(recipe=recipe), fsdp=True)
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(weight, WeightWithDynamicFloat8CastTensor) is all_gather, recipe
    Float8ScalesCallback().on_step_end(None, None, None, model=model)  # no FSDP2 here: nothing to compute


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_runs_on_cpu_close_to_bf16(recipe: str) -> None:
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    convert_linears_to_float8(model, Fp8Config(recipe=recipe), fsdp=False)
    ids = torch.randint(0, ARCH["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, m in (("bf16", reference), ("fp8", model)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grad = m.model.layers[0].mlp.up_proj.weight.grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0
        losses[name] = loss.item()
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02), losses


# -- what is saved ---------------------------------------------------------------------------------


def test_a_converted_model_saves_the_plain_tensors_transformers_loads(tmp_path: Path) -> None:
    plain, converted = tiny_llama(), tiny_llama()
    convert_linears_to_float8(converted, Fp8Config(), fsdp=False)
    plain.save_pretrained(tmp_path / "plain")
    converted.save_pretrained(tmp_path / "fp8")
    before, after = (load_file(tmp_path / name / "model.safetensors") for name in ("plain", "fp8"))
    assert {k: (v.dtype, v.shape) for k, v in after.items()} == {
        k: (v.dtype, v.shape) for k, v in before.items()
    }
    assert all(torch.equal(after[k], before[k]) for k in before)
    # Loaded where torchao cannot be imported at all: the directory needs none of it.
    script = (
        "import sys; sys.modules['torchao'] = None\n"
        "import torch\n"
        "from safetensors.torch import load_file\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'fp8')!r})\n"
        f"saved = load_file({str(tmp_path / 'fp8' / 'model.safetensors')!r})\n"
        "state = model.state_dict()\n"
        "assert all(torch.equal(state[k], v) for k, v in saved.items())\n"
        "assert {type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)} == {'Linear'}\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -- a run -----------------------------------------------------------------------------------------


def test_an_fp8_run_trains_and_writes_a_plain_final_model(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole run on CPU, with the device check answered as on an H100: the layers are converted
    after the model is built, the steps train under bf16 autocast, and final/ and the checkpoint hold
    the plain weights of an unconverted model."""
    from lmforge.monitor.metrics import read_metrics
    from lmforge.train import precision
    from lmforge.train.runner import run_training

    for module in (preflight, precision):
        monkeypatch.setattr(module, "require_fp8_device", lambda **_: None)
    cfg = load_config(write_config(tmp_path, corpus, precision="fp8", max_steps=4, save_every=4, lr=1e-3))
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        outcome = run_training(cfg)
    assert (
        "fp8 (tensorwise): 14 linear layers in float8, kept in bf16: lm_head (train.fp8.exclude)"
        in caplog.text
    )
    assert "precision: fp8" in (outcome.run_dir / "config.yaml").read_text()
    losses = [r["loss"] for r in read_metrics(outcome.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(losses) >= 2 and all(0 < loss < 10 for loss in losses), losses
    final = load_file(outcome.final_dir / "model.safetensors")
    checkpoint = load_file(outcome.run_dir / "checkpoints" / "step-4" / "model.safetensors")
    assert {k: v.dtype for k, v in final.items()} == {k: v.dtype for k, v in checkpoint.items()}
    plain = LlamaForCausalLM.from_pretrained(outcome.final_dir)
    assert {type(m).__name__ for m in plain.modules() if isinstance(m, torch.nn.Linear)} == {"Linear"}
    state = plain.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in final.items())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_fsdp2_all_gathers_float8_weights_and_final_holds_plain_tensors(tmp_path: Path, corpus: Path) -> None:
    """2 CPU ranks on gloo under FSDP2: the weights are all-gathered in float8 with scales computed
    after every step (Float8ScalesCallback), the checkpoint is torch DCP, and final/ is the plain model."""
    config = write_config(tmp_path, corpus, precision="fp8", max_steps=4, save_every=2, lr=1e-3)
    text = config.read_text() + "distributed:\n  strategy: fsdp\n"
    config.write_text(text)
    script = ROOT / "tests" / "dist_scripts" / "fp8_fsdp_worker.py"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
        str(_free_port()), str(script), str(tmp_path), str(config),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "FSDP2 all-gathers their weights in float8" in done.stderr
    for notice in ("Failed to load", "Enum subclass"):  # torchao's import notices
        assert notice not in done.stderr, notice
    for rank in (0, 1):  # at the start, then after each of the 4 steps: all 14 sharded weights have a scale
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [14] * 5
    run = tmp_path / "runs" / "bad"
    assert (run / "checkpoints" / "step-2" / "pytorch_model_fsdp_0").is_dir()
    final = load_file(run / "final" / "model.safetensors")
    plain = LlamaForCausalLM.from_pretrained(run / "final")
    state = plain.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in final.items())
