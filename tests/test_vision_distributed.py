"""A vision-language model (tiny Idefics3, SmolVLM's architecture) trained on 2 gloo processes under
DDP, FSDP2 and DeepSpeed ZeRO-3 (and a tiny LLaVA under FSDP2), with its vision tower frozen (train.vision's default), against one
process on the same global batch: the loss curves agree, the tower stays as it was, every checkpoint
carries the processor, and `lmforge ckpt consolidate` of a sharded checkpoint gives a folder that
AutoModelForImageTextToText and AutoProcessor load with the logits of the run's final/.

The four runs start together (each is mostly process start-up on 2 cores) and serve every test.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from lmforge.export.consolidate import MISSING_PROCESSOR, consolidate
from lmforge.pipeline.vlm_starter import write_shapes_starter
from tests.conftest import run_cli
from tests.forked_cli import FORK_SERVER
from tests.test_distributed import TOLERANCE, free_port, held_shares, losses

STEPS = 6
ENGINES: dict[
    str, tuple[dict[str, object], float]
] = {  # run name: (distributed section, share of the parameters each rank holds)
    "ddp": ({"strategy": "ddp"}, 1.0),
    "fsdp": ({"strategy": "fsdp"}, 0.5),
    "zero3": ({"strategy": "deepspeed", "zero_stage": 3}, 0.5),
}
TOWER = ".vision_model."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shapes task (task/) and an untrained tiny VLM (model/) with a tokenizer of its text."""
    root = tmp_path_factory.mktemp("vlm")
    write_shapes_starter(root, train_rows=64, eval_rows=4)
    return root


def _config(vlm: Path, out: Path, name: str, distributed: dict[str, object], micro_batch: int) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(out), "seed": 0},
        "model": {"path": str(vlm / "model")},
        "data": {
            "train": [{"path": str(vlm / "task" / "train.jsonl")}],
            "max_length": 64,
            "eval_fraction": 0,
        },
        "train": {
            "stage": "sft",
            "max_steps": STEPS,
            "micro_batch_size": micro_batch,
            "lr": 1e-3,
            "warmup_steps": 0,
            "log_every": 1,
            "save_every": STEPS,
            "precision": "fp32",
        },  # train.vision left at its default: the tower frozen, the projector trained
        "distributed": distributed,
        "monitor": {"loggers": [], "system_metrics_seconds": None},
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _llava(config: Path, vlm: Path) -> Path:
    settings = yaml.safe_load(config.read_text())
    settings["model"] = {"preset": "llava-tiny"}
    settings["tokenizer"] = {"path": str(vlm / "model")}
    config.write_text(yaml.safe_dump(settings))
    return config


@pytest.fixture(scope="module")
def runs(vlm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each run's directory and console: one process (4 rows a step), and 2 ranks x 2 rows per engine."""
    out = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMFORGE_CACHE": str(out / "cache")}
    cli = [FORK_SERVER.interpreter(), "-m", "lmforge.cli.main"]  # forked where it can be
    commands = {"single": [*cli, "train", str(_config(vlm, out, "single", {"strategy": "none"}, 4))]}
    for name, (distributed, _) in ENGINES.items():
        config = _config(vlm, out, name, distributed, 2)
        launch = ["launch", str(config), "--nproc-per-node", "2", "--master-port", str(free_port())]
        commands[name] = [*cli, *launch]
    # The LLaVA family (model.preset: llava-tiny, built by each run from the seed) under FSDP2.
    llava_single = _llava(_config(vlm, out, "llava-single", {"strategy": "none"}, 4), vlm)
    llava_fsdp = _llava(_config(vlm, out, "llava-fsdp", {"strategy": "fsdp"}, 2), vlm)
    commands["llava-single"] = [*cli, "train", str(llava_single)]
    commands["llava-fsdp"] = [
        *cli,
        "launch",
        str(llava_fsdp),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    started = {
        name: subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, command in commands.items()
    }
    consoles = {name: process.communicate(timeout=900)[0] for name, process in started.items()}
    for name, process in started.items():
        assert process.returncode == 0, (name, consoles[name][-4000:])
    return {name: (out / name, consoles[name]) for name in commands}


def test_each_engine_trains_the_vlm_as_one_process_does_and_keeps_the_frozen_tower(
    vlm: Path, runs: dict[str, tuple[Path, str]]
) -> None:
    single = losses(runs["single"][0])
    assert sorted(single) == list(range(1, STEPS + 1))
    assert single[STEPS] < single[1] - 0.5, single  # it learned
    base = load_file(vlm / "model" / "model.safetensors")
    for name, (_, held) in ENGINES.items():
        run_dir, console = runs[name]
        curve = losses(run_dir)
        assert sorted(curve) == sorted(single), (name, curve)
        # Same rows, images and seed: the engines change only the order of float sums.
        worst = max(abs(curve[s] - single[s]) for s in curve)
        assert worst < TOLERANCE, (name, curve, single)
        shares = held_shares(console)
        assert sorted(shares) == [0, 1] and all(abs(v - held) < 0.01 for v in shares.values()), (name, shares)
        final = load_file(run_dir / "final" / "model.safetensors")
        assert set(final) == set(base)
        frozen = [k for k in base if TOWER in k]
        assert frozen and all(torch.equal(final[k], base[k]) for k in frozen), name
        assert not torch.equal(final["lm_head.weight"], base["lm_head.weight"]), name
        # Every checkpoint carries the processor, whatever wrote it.
        assert (run_dir / "checkpoints" / f"step-{STEPS}" / "processor_config.json").is_file(), name


def test_fsdp2_trains_a_llava_model_as_one_process_does_with_its_tower_frozen(
    runs: dict[str, tuple[Path, str]],
) -> None:
    single, fsdp = losses(runs["llava-single"][0]), losses(runs["llava-fsdp"][0])
    assert sorted(fsdp) == sorted(single) == list(range(1, STEPS + 1))
    assert max(abs(fsdp[s] - single[s]) for s in fsdp) < TOLERANCE, (fsdp, single)
    shares = held_shares(runs["llava-fsdp"][1])
    assert sorted(shares) == [0, 1] and all(abs(v - 0.5) < 0.01 for v in shares.values()), shares
    # The two final/ folders may name the weights differently (transformers' LLaVA checkpoint names, or
    # its module names): compared as the loaded models' towers.
    from transformers import AutoModelForImageTextToText

    one, two = (
        AutoModelForImageTextToText.from_pretrained(runs[name][0] / "final").model.vision_tower.state_dict()
        for name in ("llava-single", "llava-fsdp")
    )
    assert "trainable: vision tower 0 of 80,640" in runs["llava-fsdp"][1]  # train.vision's default
    assert one and all(torch.equal(one[k], two[k]) for k in one)  # both still the seed's init


def _batch(vlm: Path, processor: object) -> dict[str, torch.Tensor]:
    row = json.loads((vlm / "task" / "eval.jsonl").read_text().splitlines()[0])
    image = Image.open(vlm / "task" / row["images"][0]).convert("RGB")
    text = f"<|im_start|>user\n{row['conversations'][0]['value']}<|im_end|>\n<|im_start|>assistant\n"
    return dict(processor(text=[text], images=[[image]], return_tensors="pt"))  # type: ignore[operator]


def _logits(model_dir: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_a_consolidated_sharded_vlm_checkpoint_loads_with_its_processor_and_final_logits(
    vlm: Path, runs: dict[str, tuple[Path, str]], tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoProcessor

    checkpoint = runs[name][0] / "checkpoints" / f"step-{STEPS}"
    done = run_cli("ckpt", "consolidate", str(checkpoint), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "processor" not in done.stdout  # no warning: the checkpoint carried it
    processor = AutoProcessor.from_pretrained(tmp_path / "out")
    batch = _batch(vlm, processor)
    assert batch["pixel_values"].shape[:2] == (1, 1)
    got = _logits(tmp_path / "out", batch)
    # The run's final/ is the model the engine gathered at the end (the same step as the checkpoint).
    torch.testing.assert_close(got, _logits(runs[name][0] / "final", batch), atol=1e-5, rtol=1e-5)
    assert (got - _logits(vlm / "model", batch)).abs().max() > 0.1  # trained, not the base model
    if name == "fsdp":  # a checkpoint an older lmforge wrote has no processor: said, with the fix
        old = tmp_path / "old"
        shutil.copytree(checkpoint, old)
        (old / "processor_config.json").unlink()
        with caplog.at_level(logging.WARNING, logger="lmforge.export.consolidate"):
            report = consolidate(old, tmp_path / "old-out")
        assert report.processor is False and MISSING_PROCESSOR in caplog.text
        assert "model.path" in MISSING_PROCESSOR


def test_fsdp2_shards_the_vlm_by_its_tower_and_decoder_layers(vlm: Path) -> None:
    """Idefics3 lists its tower's attention (not the layer) in _no_split_modules: the tower's whole
    encoder layer is the unit, so a frozen tower's units hold frozen parameters alone."""
    from transformers import AutoModelForImageTextToText

    from lmforge.config.schema import TrainConfig
    from lmforge.distributed.fsdp import fsdp_training_arguments
    from lmforge.models.methods import apply_training_method

    loaded = AutoModelForImageTextToText.from_pretrained(vlm / "model")
    model = apply_training_method(loaded, TrainConfig())
    layers = fsdp_training_arguments(model)["fsdp_config"]["transformer_layer_cls_to_wrap"]
    assert sorted(layers) == ["Idefics3EncoderLayer", "LlamaDecoderLayer"]
    units = [m for m in model.modules() if type(m).__name__ in layers]
    assert len(units) == 4  # 2 tower layers, 2 decoder layers
    assert {len({p.requires_grad for p in unit.parameters()}) for unit in units} == {1}
