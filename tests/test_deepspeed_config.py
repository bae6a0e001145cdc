"""The DeepSpeed configs lmforge generates or resolves, judged by DeepSpeed's own DeepSpeedConfig."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.config.schema import DistributedConfig, TrainConfig
from lmforge.distributed.deepspeed_config import generated_config, read_user_config, resolve_user_config
from lmforge.distributed.ranks import World
from lmforge.distributed.strategy import plan_for
from lmforge.errors import UserInputError
from tests.conftest import ROOT

WORLD_SIZES = (1, 2, 3, 4, 6, 8, 16, 24, 64, 128, 512)


def deepspeed_judges(pairs: list[tuple[dict[str, Any], int]]) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "dist_scripts" / "deepspeed_batch_check.py"), str(port)],
        input=json.dumps(pairs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generated_configs_pass_deepspeeds_batch_check_for_any_world_size() -> None:
    pairs = []
    for stage, offload, micro, accum, world in itertools.product(
        (1, 2, 3), ("none", "optimizer", "optimizer+params"), (1, 3), (1, 5), WORLD_SIZES
    ):
        if (offload == "optimizer+params" and stage != 3) or (offload == "optimizer" and stage == 1):
            continue
        settings = DistributedConfig(strategy="deepspeed", zero_stage=stage, offload=offload)
        train = TrainConfig(micro_batch_size=micro, grad_accum=accum)
        pairs.append((generated_config(settings, train, precision="bf16", on_gpu=True), world))
    verdicts = deepspeed_judges(pairs)
    assert len(verdicts) == len(pairs) == 264  # 6 stage/offload pairs x 4 batch shapes x 11 world sizes
    for (config, world), verdict in zip(pairs, verdicts, strict=True):
        assert verdict["ok"], verdict
        micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
        assert verdict["train_batch_size"] == micro * accum * world
        assert verdict["stage"] == config["zero_optimization"]["stage"]


def test_offload_and_zero3_settings_are_what_deepspeed_documents() -> None:
    train = TrainConfig(micro_batch_size=4, grad_accum=2, max_grad_norm=0.5)
    zero3 = generated_config(
        DistributedConfig(strategy="deepspeed", zero_stage=3, offload="optimizer+params"),
        train,
        precision="bf16",
        on_gpu=True,
    )
    zero = zero3["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # final/ gets whole weights
    assert zero3["bf16"] == {"enabled": True} and zero3["fp16"]["enabled"] is False
    assert zero3["gradient_clipping"] == 0.5 and "train_batch_size" not in zero3


def user_config(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data, indent=2) if not isinstance(data, str) else data)
    return path


def test_a_users_auto_values_are_resolved_and_pass_deepspeeds_check(tmp_path: Path) -> None:
    data = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    train = TrainConfig(micro_batch_size=3, grad_accum=4, max_grad_norm=1.5)
    resolved = {
        world: resolve_user_config(
            read_user_config(user_config(tmp_path, data)),
            train,
            precision="fp16",
            world_size=world,
            source="ds.json",
        )
        for world in WORLD_SIZES
    }
    one = resolved[8]
    assert one["train_micro_batch_size_per_gpu"] == 3 and one["gradient_accumulation_steps"] == 4
    assert one["gradient_clipping"] == 1.5 and "train_batch_size" not in one
    assert one["bf16"]["enabled"] is False and one["fp16"]["enabled"] is True
    # The JSON's optimizer runs, with train.* numbers in place of its "auto"s (the file shows them).
    assert one["optimizer"]["params"]["lr"] == train.lr
    # ZeRO-3 gathers whole weights on save, or final/ would hold none.
    assert one["zero_optimization"] == {
        **data["zero_optimization"],
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    verdicts = deepspeed_judges([(config, world) for world, config in resolved.items()])
    assert [v["train_batch_size"] for v in verdicts] == [3 * 4 * w for w in WORLD_SIZES]


def config_with_json(path: Path, train: dict[str, Any]) -> Any:
    """A tiny run's config with the user's DeepSpeed JSON at `path` and these train.* settings."""
    return tiny(train=train, strategy="deepspeed", deepspeed_config=str(path))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            '{\n  "zero_optimization": {"stage": 2},\n  "bf16": {enabled: true}\n}',
            r"ds\.json:3: not valid JSON",
        ),
        ("[1, 2]", "must hold a JSON object"),
        (
            {"train_batch_size": 32},
            r"train_batch_size is 32, but micro-batch 2 x accumulation 1 x world size 4 = 8",
        ),
        (
            {"train_micro_batch_size_per_gpu": 8},
            r"train_micro_batch_size_per_gpu is 8 but train.micro_batch_size is 2",
        ),
        ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage must be 0, 1, 2 or 3"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
            r"optimizer.params.lr is 0.0001 but lmforge trains with 0.0003 \(train.lr\).*write \"auto\"",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}}},
            r"scheduler.params.warmup_num_steps is 1000 but lmforge trains with 1 \(train.warmup_steps",
        ),
        (
            {"bf16": {"enabled": True}},
            r"bf16.enabled is true but train.precision resolved to fp32; set train.precision: bf16",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}},
            r"total_num_steps is 500 but the run length is counted in train.epochs",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
            "the final model would be saved without weights",
        ),
    ],
)
def test_a_bad_users_config_is_refused_before_training_naming_the_problem(
    tmp_path: Path, data: Any, message: str
) -> None:
    cfg = config_with_json(user_config(tmp_path, data), {"micro_batch_size": 2})
    with pytest.raises(UserInputError, match=message):
        plan_for(cfg, precision="fp32", on_gpu=False, world=World(size=4, local_size=4, rank=0))


def test_a_missing_users_config_names_the_key_and_the_path(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"distributed.deepspeed_config: .*nope.json: cannot read it"):
        read_user_config(tmp_path / "nope.json")


def tiny(train: dict[str, Any] | None = None, **distributed: Any) -> Any:
    return load_config(
        None,
        base={
            "model": {"preset": "llama-tiny"},
            "tokenizer": {"train": {"vocab_size": 300}},
            "data": {"train": [{"path": "x.jsonl"}]},
            "train": train or {},
            "distributed": distributed,
        },
    )


def test_auto_picks_one_process_alone_and_the_estimators_choice_for_several() -> None:
    assert plan_for(tiny(), precision="fp32", on_gpu=False, world=World(1, 1, 0)).engine == "none"
    plan = plan_for(tiny(), precision="fp32", on_gpu=False, world=World(4, 2, 1))
    assert plan.engine == "ddp"  # a few M parameters fit anywhere: the cheapest strategy wins
    assert "auto: ddp is the cheapest strategy that fits" in plan.describe()
    assert plan.summary()["world_size"] == 4


def test_strategy_none_with_several_workers_is_refused() -> None:
    with pytest.raises(UserInputError, match="distributed.strategy is none but 2 workers were launched"):
        plan_for(tiny(strategy="none"), precision="fp32", on_gpu=False, world=World(2, 2, 0))


@pytest.mark.parametrize(
    ("distributed", "message"),
    [
        ({"strategy": "ddp", "offload": "optimizer"}, "offload needs a sharding strategy"),
        ({"strategy": "deepspeed", "zero_stage": 2, "offload": "optimizer+params"}, "only ZeRO-3 partitions"),
        ({"strategy": "deepspeed", "zero_stage": 1, "offload": "optimizer"}, "from ZeRO-2 up"),
        ({"strategy": "fsdp", "offload": "optimizer"}, "offload: optimizer\\+params"),
        ({"strategy": "ddp", "deepspeed_config": "ds.json"}, "a DeepSpeed JSON needs distributed.strategy"),
    ],
)
def test_impossible_distributed_settings_fail_at_load_naming_the_key(distributed: dict, message: str) -> None:
    with pytest.raises(UserInputError, match=message) as caught:
        tiny(**distributed)
    assert "distributed." in str(caught.value)


def test_the_shipped_deepspeed_json_resolves_for_its_example() -> None:
    cfg = load_config(ROOT / "examples" / "distributed_zero3_offload.yaml")
    assert cfg.distributed.deepspeed_config is not None
    config = resolve_user_config(
        read_user_config(ROOT / cfg.distributed.deepspeed_config),
        cfg.train,
        precision="bf16",
        world_size=16,
        source="zero3_offload.json",
    )
    assert config["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch_size
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert deepspeed_judges([(config, 16)])[0]["train_batch_size"] == cfg.train.micro_batch_size * 16


TUTORIAL_JSON = {  # the tutorial's ZeRO-2 file: its own optimizer and WarmupLR, everything "auto"
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def _plan_with_json(tmp_path: Path, data: dict[str, Any], **train: Any) -> Any:
    cfg = config_with_json(
        user_config(tmp_path, data),
        {"micro_batch_size": 2, "lr": 2e-4, "warmup_steps": 10, "max_steps": 100, **train},
    )
    return cfg, plan_for(cfg, precision="bf16", on_gpu=False, world=World(size=2, local_size=2, rank=0))


def test_a_users_optimizer_and_warmuplr_run_with_real_numbers_and_the_banner_says_so(tmp_path: Path) -> None:
    cfg, plan = _plan_with_json(tmp_path, TUTORIAL_JSON)
    resolved = plan.deepspeed
    assert resolved["optimizer"]["params"] == {
        "lr": 2e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 2e-4,
        "warmup_num_steps": 10,
    }
    assert resolved["bf16"] == {"enabled": True} and resolved["fp16"] == {"enabled": False}
    assert "auto" not in json.dumps(resolved)
    assert plan.optimizer_and_schedule(cfg.train) == (
        "optimizer: DeepSpeed AdamW from your JSON (lr 0.0002); lr schedule: DeepSpeed WarmupLR from your "
        "JSON, log warmup 0 -> 0.0002 over 10 steps, then flat (no decay)"
    )
    # DeepSpeed's own defaults (peak 1e-3 over 1000 steps) never silently replace train.*.
    _, plan = _plan_with_json(
        tmp_path, {"scheduler": {"type": "WarmupDecayLR"}, "optimizer": {"type": "Adam"}}
    )
    assert plan.deepspeed["scheduler"]["params"] == {
        "warmup_max_lr": 2e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert plan.deepspeed["optimizer"]["params"] == {"lr": 2e-4}
    assert "then linear decay to step 100" in plan.optimizer_and_schedule(cfg.train)


def test_a_json_scheduler_and_a_configured_train_schedule_are_not_mixed(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as caught:
        _plan_with_json(tmp_path, TUTORIAL_JSON, schedule="cosine")
    assert str(caught.value).endswith(
        "the JSON's scheduler (WarmupLR) and train.schedule (cosine) would both decide the learning rate. "
        "Remove the scheduler block from the JSON to use train.schedule, or remove train.schedule from the "
        "config to run the JSON's scheduler"
    )
    # Without a scheduler block, train.schedule decides, and the banner says so.
    no_scheduler = {k: v for k, v in TUTORIAL_JSON.items() if k != "scheduler"}
    cfg, plan = _plan_with_json(tmp_path, no_scheduler, schedule="linear")
    assert plan.optimizer_and_schedule(cfg.train).endswith(
        "lr schedule: linear after 10 warmup steps (train.schedule)"
    )
