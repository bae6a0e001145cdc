"""vLLM generation of online RL on a machine without CUDA: the settings reach TRL's config, the
rules refuse settings that would do nothing, and `lmforge launch` plans the vLLM server of server
mode (its GPUs, 127.0.0.1, the training processes' GPUs) and refuses to start without the GPUs.
The generation itself needs CUDA and the vllm package (bench/gpu_open_items.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from trl import GRPOConfig

from lmforge.config import dump_config, load_config
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.train.rewards import RewardSet
from lmforge.train.stages.online_rl import rl_config_values
from tests.conftest import run_cli, save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm")
    tokenizer = train_tokenizer(
        ["What is 1 + 2? 3"] * 20, TokenizerTrainConfig(vocab_size=300, min_frequency=1)
    )
    return save_tiny_llama(tokenizer, out / "policy")


def config(tmp_path: Path, model_dir: Path, rl: dict, stage: str = "grpo") -> Path:  # type: ignore[type-arg]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "What is 1 + 2?", "answer": "3"}\n' * 8)
    path = tmp_path / "rl.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "rl", "output_dir": str(tmp_path / "runs")},
                "model": {"path": str(model_dir)},
                "data": {"train": [{"path": str(rows)}]},
                "train": {"stage": stage, "rl": rl},
            }
        )
    )
    return path


def test_vllm_settings_reach_trls_config(tmp_path: Path, model_dir: Path) -> None:
    rl = {
        "generation": "vllm",
        "vllm": {
            "mode": "server",
            "server_port": 8123,
            "importance_sampling": "token_truncate",
            "importance_sampling_max": 2.0,
        },
    }
    cfg = load_config(config(tmp_path, model_dir, rl))
    values = rl_config_values(cfg.train, RewardSet([], [1.0]), use_vllm=True)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **values)
    assert (args.use_vllm, args.vllm_mode, args.vllm_server_base_url) == (
        True,
        "server",
        "http://127.0.0.1:8123",
    )
    assert args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode == "token_truncate"
    assert args.vllm_importance_sampling_clip_max == 2.0
    off = load_config(
        config(tmp_path, model_dir, {"generation": "vllm", "vllm": {"importance_sampling": "off"}})
    )
    values = rl_config_values(off.train, RewardSet([], [1.0]), use_vllm=True)
    assert values["vllm_importance_sampling_correction"] is False and values["vllm_mode"] == "colocate"


@pytest.mark.parametrize(
    ("rl", "stage", "key", "reason"),
    [
        ({"generation": "transformers", "vllm": {"mode": "server"}}, "grpo", "train.rl.vllm", "do nothing"),
        ({"vllm": {"mode": "server"}}, "grpo", "train.rl.vllm.mode", "set train.rl.generation: vllm"),
        ({"generation": "vllm", "vllm": {"importance_sampling": "token_mask"}}, "rloo", "importance_sampling", "RLOOTrainer has none"),
    ],
)  # fmt: skip
def test_vllm_settings_that_would_do_nothing_are_refused(
    tmp_path: Path,
    model_dir: Path,
    rl: dict,
    stage: str,
    key: str,
    reason: str,  # type: ignore[type-arg]
) -> None:
    result = run_cli("config", "show", str(config(tmp_path, model_dir, rl, stage)))
    assert result.returncode == 2 and key in result.stderr and reason in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_launch_plans_the_vllm_server_and_refuses_without_its_gpus(tmp_path: Path, model_dir: Path) -> None:
    """--dry-run shows the split (training on GPUs 0-1, the server on GPU 2, 127.0.0.1) and the
    server's command; a real launch on a machine without those GPUs stops before anything starts."""
    path = config(
        tmp_path, model_dir, {"generation": "vllm", "vllm": {"mode": "server", "server_port": 8011}}
    )
    shown = run_cli("launch", str(path), "--nproc-per-node", "2", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    assert "export CUDA_VISIBLE_DEVICES=0,1" in shown.stdout
    assert "export LMFORGE_VLLM_SERVER=http://127.0.0.1:8011" in shown.stdout
    server = next(line for line in shown.stdout.splitlines() if "vllm-serve" in line)
    assert "CUDA_VISIBLE_DEVICES=2 " in server and f"--model {model_dir}" in server
    assert "--host 127.0.0.1 --port 8011" in server and "--tensor-parallel-size 1" in server
    refused = run_cli("launch", str(path), "--nproc-per-node", "2")
    assert refused.returncode == 2, refused.stderr
    assert "3 GPUs, and this machine has 0" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "runs" / "rl" / "vllm_server.log").exists()
    # `lmforge train` alone has no server beside it: told to launch, before any model work.
    alone = run_cli("train", str(path))
    assert alone.returncode == 2 and "lmforge launch CONFIG --nproc-per-node N" in alone.stderr, alone.stderr


@pytest.mark.parametrize("stage", ["grpo", "rloo"])
@pytest.mark.parametrize("generation", ["transformers", "auto", "vllm"])
def test_a_runs_config_yaml_loads_again_whatever_its_generation(
    tmp_path: Path, model_dir: Path, stage: str, generation: str
) -> None:
    """config.yaml writes vLLM's settings only where they apply: written whole, they would trip the
    rules above when the run (or `lmforge config show` of it) loads it again."""
    cfg = load_config(config(tmp_path, model_dir, {"generation": generation}, stage))
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(dump_config(cfg)))
    assert dump_config(load_config(again)) == dump_config(cfg)
