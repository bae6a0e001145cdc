"""Config loading: precise errors (file, line, key, fix), overrides, redaction, shipped examples."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmforge.config import dump_config, load_config
from lmforge.config.redact import REDACTED, redact
from lmforge.errors import UserInputError
from tests.conftest import ROOT, run_cli

VALID = """\
run:
  name: t
model:
  preset: llama-tiny
tokenizer:
  train:
    vocab_size: 512
data:
  train:
    - path: corpus.txt
  max_length: 64
train:
  max_steps: 3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def errors_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserInputError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_valid_config_fills_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID))
    assert cfg.train.max_steps == 3
    assert cfg.train.lr == 3e-4
    assert cfg.model.trust_remote_code is False
    assert cfg.run.dir == Path("runs/t")


def test_unknown_key_names_file_line_path_and_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("  max_steps: 3", "  max_step: 3"))
    message = errors_of(path)
    assert f"{path}:13: train.max_step: unknown key; did you mean 'train.max_steps'?" in message


def test_key_in_wrong_section_is_suggested_by_full_path(tmp_path: Path) -> None:
    message = errors_of(write(tmp_path, VALID + "  max_length: 12\n"))
    assert "train.max_length: unknown key; did you mean 'data.max_length'?" in message


def test_all_problems_reported_at_once_in_line_order(tmp_path: Path) -> None:
    text = VALID.replace("max_length: 64", "max_length: -1").replace("max_steps: 3", "max_steps: lots")
    message = errors_of(write(tmp_path, text))
    assert "2 problems" in message
    first, second = message.index("data.max_length"), message.index("train.max_steps")
    assert first < second
    assert "greater than or equal to 8, got -1" in message
    assert "got 'lots'" in message


def test_bad_literal_lists_choices(tmp_path: Path) -> None:
    message = errors_of(write(tmp_path, VALID), ["train.precision=fp4"])
    assert "override train.precision" in message
    assert "'auto', 'fp32', 'bf16', 'fp16' or 'fp8'" in message


def test_missing_section_and_model_source(tmp_path: Path) -> None:
    message = errors_of(write(tmp_path, "model: {}\n"))
    assert "data: required key is missing" in message
    assert "set one of model.preset, model.path or model.config" in message


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    message = errors_of(write(tmp_path, "run:\n  name: [unclosed\n"))
    assert f"{tmp_path / 'cfg.yaml'}:" in message and "not valid YAML" in message


def test_overrides_are_typed_and_dotted(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, VALID),
        [
            "train.lr=1e-4",
            "train.gradient_checkpointing=true",
            "data.train.0.path=other.txt",
            "model.config={num_hidden_layers: 2}",
        ],
    )
    assert cfg.train.lr == 1e-4
    assert cfg.train.gradient_checkpointing is True
    assert cfg.data.train[0].path == "other.txt"
    assert cfg.model.config == {"num_hidden_layers": 2}


def test_malformed_override_says_how(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="write dotted.key=value"):
        load_config(write(tmp_path, VALID), ["train.lr"])


def test_redaction_by_key_name_and_by_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123456")
    data = {
        "hf_token": "abc",
        "url": "https://x/?k=wandb-secret-123456",
        "max_new_tokens": 5,
        "nested": [{"password": "p"}],
        "eos_token": "<eos>",
    }
    out = redact(data)
    assert out["hf_token"] == REDACTED
    assert "wandb-secret-123456" not in out["url"]
    assert out["nested"][0]["password"] == REDACTED
    assert out["max_new_tokens"] == 5 and out["eos_token"] == "<eos>"


def test_secret_key_names_match_whole_parts_only() -> None:
    from lmforge.config.redact import is_secret_key

    for name in ("hf_token", "HF_TOKEN", "WANDB_API_KEY", "openai_key", "db-password", "slack_webhook_url"):
        assert is_secret_key(name), name
    for name in ("tokenizer_fingerprint", "max_new_tokens", "pad_token", "tokens_seen", "key_path", "monkey"):
        assert not is_secret_key(name), name


def test_dump_redacts_secret_env_values_in_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    cfg = load_config(write(tmp_path, VALID), ["run.name=hf_supersecretvalue"])
    assert "hf_supersecretvalue" not in yaml.safe_dump(dump_config(cfg))


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_example_validates(example: Path) -> None:
    """Each example loads, and so does its resolved dump (what a run writes to config.yaml and `lmforge
    config show` prints: every default filled in), so a run's config.yaml can be run again."""
    dumped = dump_config(load_config(example))
    assert dump_config(load_config(None, base=dumped)) == dumped


def test_cli_exit_code_2_and_message_for_bad_config(tmp_path: Path) -> None:
    path = write(
        tmp_path, VALID.replace("  lr", "  lr").replace("max_steps: 3", "max_steps: 3\n  learning_rate: 1")
    )
    result = run_cli("config", "show", str(path))
    assert result.returncode == 2
    assert "train.learning_rate: unknown key; did you mean 'train.lr'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_config_show_applies_overrides(tmp_path: Path) -> None:
    result = run_cli("config", "show", str(write(tmp_path, VALID)), "train.lr=0.01")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["train"]["lr"] == 0.01
    assert shown["model"]["trust_remote_code"] is False


def test_cli_config_schema_lists_every_key_with_description() -> None:
    result = run_cli("config", "schema")
    assert result.returncode == 0, result.stderr
    for key in ("run.output_dir", "data.max_length", "train.resume", "debug.crash_at_step"):
        assert key in result.stdout


def test_cross_section_rules_are_reported_with_the_fix(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    message = errors_of(path, ["train.stage=sft", "data.padding_free=true"])
    assert (
        "override data.padding_free: padding-free batches keep samples apart only under flash_attention_2"
        in message
    )
    message = errors_of(path, ["data.packing=true"])
    assert "pretraining already packs text into full blocks" in message
    message = errors_of(path, ["data.train.0.format=alpaca"])
    assert "train.stage: pretrain reads raw text" in message
    message = errors_of(path, ["train.stage=sft", "data.train.0.format=messages"])
    assert f"{path}:6: tokenizer.train: tokenizer.train learns from raw text sources" in message


def test_sft_with_packing_on_sdpa_is_accepted(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, VALID),
        [
            "train.stage=sft",
            "data.packing=true",
            "data.train.0.format=messages",
            "tokenizer.train=null",
            "tokenizer.path=tok",
        ],
    )
    assert cfg.data.packing and cfg.train.stage == "sft"


def test_kto_needs_micro_batches_of_two(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="train.micro_batch_size.*KTO estimates its KL term"):
        load_config(
            None,
            base={
                "model": {"path": str(tmp_path)},
                "data": {"train": [{"path": "rows.jsonl", "format": "kto"}]},
                "train": {"stage": "kto", "micro_batch_size": 1},
            },
        )


def test_yaml_alias_bomb_is_refused_in_seconds_and_plain_anchors_still_work(tmp_path: Path) -> None:
    # Nine levels of nine aliases: 9**9 (387 million) leaves once expanded; `config show` grew to
    # gigabytes before the expanded size was bounded.
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    result = run_cli("config", "show", str(bomb), timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{bomb}:" in result.stderr and "alias bomb" in result.stderr
    assert "Traceback" not in result.stderr
    recursive = write(tmp_path, "run: &r {name: x, again: *r}\n")
    assert "refers to the node that contains it" in errors_of(recursive)
    # Anchors used the way people use them (one block shared by two sources) still load.
    shared = VALID.replace(
        "    - path: corpus.txt\n", "    - &src {path: corpus.txt, max_documents: 2}\n    - *src\n"
    )
    cfg = load_config(write(tmp_path, shared))
    assert [source.max_documents for source in cfg.data.train] == [2, 2]


def test_null_means_the_default_for_keys_that_have_one(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID), ["train.warmup_steps=null", "train.lora=null"])
    assert cfg.train.warmup_steps == 0 and cfg.train.lora.r == 8
    # Where None means something of its own (no step limit), it is kept.
    assert load_config(write(tmp_path, VALID), ["train.max_steps=null"]).train.max_steps is None


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["data.streaming=true", "data.store.tasks=2"], "data.streaming", "choose one"),
        (["data.streaming=true", "train.max_steps=null"], "train.max_steps", "no length"),
        (["data.streaming=true", "data.eval_fraction=0.1"], "data.eval_fraction", "cannot hold out"),
        (["data.streaming=true", "distributed.tensor_parallel=2"], "data.streaming", "data.store"),
        (["data.train.0.weight=2"], "data.train", "data.streaming: true or data.store"),
        (["data.train.0.max_tokens=1000"], "data.train", "data.streaming: true or data.store"),
        (["data.store.tasks=2", "data.train.0.max_documents=5"], "data.train", "use max_tokens"),
        (["data.train.0.weight=0"], "data.train.0.weight", "greater than 0"),
        (["data.train.0.weight=-1"], "data.train.0.weight", "greater than 0"),
    ],
)
def test_streaming_and_store_settings_that_cannot_work_are_refused_naming_the_key(
    tmp_path: Path, overrides: list[str], key: str, words: str
) -> None:
    errors = errors_of(write(tmp_path, VALID), overrides)
    assert key in errors and words in errors, errors


def test_the_store_holds_pretraining_text_only(tmp_path: Path) -> None:
    errors = errors_of(write(tmp_path, VALID), ["train.stage=dpo", "data.store.tasks=2"])
    assert "data.store" in errors and "pretraining text" in errors


def test_a_shorthand_value_is_quoted_as_written(tmp_path: Path) -> None:
    """`optimizer: adamw_torch` (the HF Trainer's name) fails at `train.optimizer.name`, a key the
    file does not spell out: the message still quotes what the user wrote."""
    text = VALID.replace("max_steps: 3", "max_steps: 3\n  optimizer: adamw_torch")
    message = errors_of(write(tmp_path, text))
    assert "train.optimizer.name: Input should be 'adamw'" in message
    assert "got 'adamw_torch'" in message
