"""Mixture-of-Experts models: the tiny presets of three families build with transformers 5's fused
experts, model.moe reaches the HF config (and is refused where it cannot apply), every logged step
records the expert load in metrics.jsonl, TensorBoard and the report, with each layer's counts
summing to the step's real tokens x top_k, and LoRA covers the experts, with an audit that says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from lmforge.config.schema import LoraConfig, ModelConfig, MoeConfig, TokenizerTrainConfig, TrainConfig
from lmforge.data.collate import PackedCollator, PaddedCollator
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.models.build import build_model
from lmforge.models.methods import apply_training_method
from lmforge.run_layout import RunPaths
from lmforge.train.moe_metrics import ExpertLoad, load_metrics, real_token_mask, router_sites
from tests.conftest import ROOT, SMALL_ARCH, WORDS, run_cli

ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"
PRESETS = ("qwen2-moe-tiny", "qwen3-moe-tiny", "mixtral-tiny")
# Each preset narrowed (4 experts and top-2 kept) so that a run takes seconds.
NARROW: dict[str, dict[str, Any]] = {
    "qwen2-moe-tiny": {**SMALL_ARCH, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
    "qwen3-moe-tiny": {**SMALL_ARCH, "moe_intermediate_size": 64},
    "mixtral-tiny": {**SMALL_ARCH, "intermediate_size": 64},
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    texts = [" ".join(WORDS)] * 50 + ALPACA.read_text().splitlines()
    return train_tokenizer(texts * 2, TokenizerTrainConfig(vocab_size=300, min_frequency=1))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A narrowed, untrained qwen3-moe-tiny with the tokenizer: the base the LoRA runs adapt."""
    out = tmp_path_factory.mktemp("moe-base")
    torch.manual_seed(0)
    config = ModelConfig(preset="qwen3-moe-tiny", config=NARROW["qwen3-moe-tiny"])
    build_model(config, tokenizer, max_length=128).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def pretrain_config(
    tmp_path: Path, corpus: Path, tokenizer_dir: Path, model: dict[str, Any]
) -> dict[str, Any]:
    return {
        "run": {"name": "moe", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": model,
        "tokenizer": {"path": str(tokenizer_dir)},
        "data": {"train": [{"path": str(corpus)}], "max_length": 32},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 4,
            "grad_accum": 2,  # the counts of one step sum over its micro-batches
            "lr": 1e-2,
            "precision": "fp32",
            "log_every": 1,
            "save_every": None,
        },
        "monitor": {"system_metrics_seconds": None},
    }


def logged_steps(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def routed_per_layer(record: dict[str, Any]) -> dict[int, int]:
    """Tokens x top-k each layer routed in the record's step, from its per-expert counts."""
    layers: dict[int, int] = {}
    for key, value in record.items():
        if key.startswith("moe/layer") and key.endswith("_tokens"):
            layer = int(key.split("/")[1].removeprefix("layer"))
            layers[layer] = layers.get(layer, 0) + value
    return layers


def assert_counts_match_real_tokens(records: list[dict[str, Any]], *, top_k: int, layers: int) -> None:
    """Every logged step (log_every 1): each layer routed exactly that step's real tokens x top_k."""
    seen = 0
    for record in records:
        tokens, seen = record["tokens_seen"] - seen, record["tokens_seen"]
        assert tokens > 0
        assert routed_per_layer(record) == dict.fromkeys(range(layers), tokens * top_k), record["step"]


# -- presets and router settings ---------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_moe_presets_build_fused_experts_top2_of_4(preset: str, tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_model(ModelConfig(preset=preset), tokenizer, max_length=128)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # transformers 5 holds a layer's experts in two 3-D parameters, not in Linear layers.
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 2 * 344, 256)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 256, 344)
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 256)
    assert model.config.num_experts_per_tok == 2 and model.config.num_hidden_layers == 4
    assert 4e6 < sum(p.numel() for p in model.parameters()) < 7e6  # llama-tiny: 3M with this vocabulary


def test_model_moe_reaches_the_hf_config(tokenizer: PreTrainedTokenizerFast) -> None:
    settings = MoeConfig(top_k=1, router_aux_loss_coef=0.05)
    model = build_model(ModelConfig(preset="mixtral-tiny", moe=settings), tokenizer, max_length=64)
    assert model.config.num_experts_per_tok == 1 and model.config.router_aux_loss_coef == 0.05
    assert model.model.layers[0].mlp.gate.top_k == 1  # what the router itself runs with


@pytest.mark.parametrize(
    ("preset", "settings", "expected"),
    [
        (
            "mixtral-tiny",
            {"router_z_loss_coef": 0.001},
            "model.moe.router_z_loss_coef: the mixtral family has no",
        ),
        ("qwen2-moe-tiny", {"top_k": 5}, "model.moe.top_k=5 but the model has 4 experts per layer"),
        ("llama-tiny", {"top_k": 2}, "model.moe: llama is not a Mixture-of-Experts model"),
    ],
)
def test_router_settings_the_model_cannot_take_are_refused(
    preset: str, settings: dict[str, Any], expected: str, tokenizer: PreTrainedTokenizerFast
) -> None:
    with pytest.raises(UserInputError, match=expected):
        build_model(ModelConfig(preset=preset, moe=MoeConfig(**settings)), tokenizer, max_length=64)


def test_training_forwards_add_the_router_loss_and_evaluation_leaves_it_out(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    base = build_model(
        ModelConfig(preset="mixtral-tiny", config=NARROW["mixtral-tiny"]), tokenizer, max_length=64
    )
    model = apply_training_method(base, TrainConfig())
    ids = torch.randint(0, len(tokenizer), (2, 16))
    trained = model.train()(input_ids=ids, labels=ids)
    with torch.no_grad():
        evaluated = model.eval()(input_ids=ids, labels=ids)
    assert trained.aux_loss is not None and evaluated.aux_loss is None
    coef = model.config.router_aux_loss_coef
    assert torch.allclose(trained.loss, evaluated.loss + coef * trained.aux_loss, atol=1e-5)
    assert model.config.output_router_logits is False  # final/config.json keeps the model's own value


# -- the counting ------------------------------------------------------------------------------


def test_load_metrics_per_layer_and_worst_layer() -> None:
    record = load_metrics([[4, 4, 4, 4], [10, 2, 2, 2]], [0, 3])
    assert record["moe/layer3/expert0_tokens"] == 10
    assert record["moe/layer0/max_over_mean"] == 1.0 and record["moe/layer0/cv"] == 0.0
    assert record["moe/layer3/max_over_mean"] == 2.5
    assert record["moe/layer3/cv"] == pytest.approx(((6**2 + 3 * 2**2) / 4) ** 0.5 / 4)
    assert record["moe_load_max_over_mean"] == 2.5 and record["moe_load_cv"] == record["moe/layer3/cv"]


def test_real_tokens_of_padded_and_packed_batches() -> None:
    samples = [{"input_ids": [5] * n, "labels": [5] * n} for n in (3, 7, 4)]
    padded = PaddedCollator(pad_token_id=0)(samples)
    assert int(real_token_mask(padded["attention_mask"]).sum()) == 14
    # Packed rows carry a 4-D block-diagonal mask: padding is what attends only to itself.
    rows = [[samples[0], samples[1]], [samples[2]]]
    for implementation in ("sdpa", "eager"):
        packed = PackedCollator(pad_token_id=0, attn_implementation=implementation)(rows)
        mask = real_token_mask(packed["attention_mask"])
        assert mask is not None and mask.tolist() == [True] * 10 + [True] * 4 + [False] * 6


def test_only_training_forwards_count_not_recomputation_or_evaluation(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    base = build_model(
        ModelConfig(preset="mixtral-tiny", config=NARROW["mixtral-tiny"]), tokenizer, max_length=64
    )
    model = apply_training_method(base, TrainConfig())  # a training forward returns the aux loss
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load = ExpertLoad(model, router_sites(model))
    ids = torch.randint(0, len(tokenizer), (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # 6 pads
    model.train()(
        input_ids=ids, attention_mask=mask, labels=ids
    ).loss.backward()  # layers recompute in backward
    with torch.no_grad():
        model.eval()(input_ids=ids, attention_mask=mask)
    record = load.take(world_size=1)
    assert routed_per_layer(record) == {0: 42 * 2, 1: 42 * 2}
    assert record["moe_aux_loss"] > 0
    assert routed_per_layer(load.take(world_size=1)) == {0: 0, 1: 0}  # taking starts the tally again


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_pretraining_each_moe_preset_records_expert_load_every_logged_step(
    preset: str, tmp_path: Path, corpus: Path, tokenizer_dir: Path
) -> None:
    # qwen2-moe-tiny runs with its router settings from the config: top-1, a larger aux weight.
    moe = {"top_k": 1, "router_aux_loss_coef": 0.02} if preset == "qwen2-moe-tiny" else None
    model = {"preset": preset, "config": NARROW[preset], **({"moe": moe} if moe else {})}
    config = pretrain_config(tmp_path, corpus, tokenizer_dir, model)
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "moe"
    records = logged_steps(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    top_k = 1 if moe else 2
    assert_counts_match_real_tokens(records, top_k=top_k, layers=2)
    for record in records:
        assert all(0 < record[key] < 10 for key in ("loss", "moe_aux_loss"))
        assert record["moe_load_max_over_mean"] >= 1 and record["moe_load_cv"] >= 0
        assert record["moe/layer1/max_over_mean"] <= record["moe_load_max_over_mean"]
        assert "moe_z_loss" not in record and "moe_dropped_tokens" not in record  # none in this family
    assert records[-1]["loss"] < records[0]["loss"]
    saved = json.loads((run / "final" / "config.json").read_text())
    assert saved["num_experts_per_tok"] == top_k and saved["router_aux_loss_coef"] == (0.02 if moe else 0.001)
    assert "dropless (no capacity factor" in result.stderr
    if preset == "mixtral-tiny":  # the other sinks and the report, checked once
        assert_tensorboard_and_report(run, records)


def assert_tensorboard_and_report(run: Path, records: list[dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(RunPaths(run).tensorboard))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("moe/layer0/expert3_tokens", "moe/layer1/cv", "moe_load_max_over_mean", "moe_aux_loss"):
        assert key in tags
        assert [s.step for s in events.Scalars(key)] == [r["step"] for r in records]
    assert [s.value for s in events.Scalars("moe/layer0/expert3_tokens")] == [
        r["moe/layer0/expert3_tokens"] for r in records
    ]
    page = (run / "report.html").read_text()
    section = page.split("<h2>Mixture of experts</h2>")[1].split("<h2>")[0]
    assert 'data-metric="stage_moe_aux_loss"' in section and 'data-metric="stage_moe_load_cv"' in section
    assert "Expert load: share of routed tokens per expert" in section
    assert "<td>layer 0</td>" in section and "<td>layer 1</td>" in section and "<th>expert 3</th>" in section
    assert "routes dropless (no capacity factor)" in section


@pytest.mark.slow
def test_lora_on_moe_adapts_the_experts_and_counts_only_real_tokens(tmp_path: Path, moe_base: Path) -> None:
    config = {
        "run": {"name": "lora", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(moe_base)},
        "data": {"train": [{"path": str(ALPACA)}], "max_length": 64, "over_length": "truncate"},
        "train": {
            "stage": "sft",
            "method": "lora",
            "lora": {"r": 4},  # all-linear: the fused experts are targeted too
            "max_steps": 3,
            "micro_batch_size": 4,  # padded to the longest sample: the pads must not count
            "lr": 1e-2,
            "precision": "fp32",
            "log_every": 1,
            "save_every": None,
        },
        "monitor": {"system_metrics_seconds": None, "loggers": []},
        # The adapter is merged (PEFT's merge: adapters on the fused experts) and the merged model is
        # verified against the adapter on its base, in its own runtime.
        "export": {"formats": ["safetensors"]},
    }
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "lora"
    verdict = json.loads((run / "export" / "export.json").read_text())["artifacts"]["safetensors"][
        "verification"
    ]
    assert verdict["passed"], verdict["failures"]
    assert_counts_match_real_tokens(logged_steps(run), top_k=2, layers=2)
    audit = json.loads(RunPaths(run).adapter_audit.read_text())
    assert audit["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    adapted = {(g["kind"], g["name"]): g for g in audit["groups"]}
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        group = adapted[("parameter", f"model.layers.*.mlp.{name}")]
        assert group["count"] == 2 and group["trainable_parameters"] > 0
    assert ("module", "model.layers.*.self_attn.q_proj") in adapted
    assert audit["trainable_parameters"] == sum(g["trainable_parameters"] for g in audit["groups"])
    assert "adapter audit:" in result.stderr and "model.layers.*.mlp.experts.gate_up_proj" in result.stderr
    with safe_open(str(run / "final" / "adapter" / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
    assert any("mlp.experts" in k and "lora_A" in k for k in keys), keys
    assert any("mlp.experts.base_layer.lora_B" in k for k in keys), keys  # both expert parameters


@pytest.mark.integration
@pytest.mark.parametrize(
    ("stage", "data"),
    [("dpo", "arithmetic_preference.jsonl"), ("kto", "arithmetic_kto.jsonl"), ("grpo", None)],
)
def test_preference_and_rl_stages_train_lora_on_an_moe_model(
    tmp_path: Path, moe_base: Path, stage: str, data: str | None
) -> None:
    """TRL's DPO, KTO and GRPO over a LoRA on an MoE model: the experts get adapters, and every logged
    step carries the expert load of its training forwards. Forwards without gradients (the
    reference's log-probabilities with the adapter off, KTO's KL pass, GRPO's sampling) are not
    counted, so DPO's and GRPO's counts are the step's tokens x top-k, and KTO's the share of its
    tokens that trained (its KL pass runs the mismatched pairs as well)."""
    config = {
        "run": {"name": stage, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(moe_base)},
        "data": {"train": [{"path": str(ROOT / "examples" / "data" / (data or "arithmetic_alpaca.jsonl"))}],
                 "max_length": 64, "over_length": "truncate"},
        "train": {"stage": stage, "method": "lora", "lora": {"r": 4}, "max_steps": 2, "micro_batch_size": 4,
                  "lr": 1e-3, "precision": "fp32", "log_every": 1, "save_every": None,
                  **({"rl": {"group_size": 4, "max_completion_length": 8}} if stage == "grpo" else {})},
        "monitor": {"system_metrics_seconds": None, "loggers": []},
    }  # fmt: skip
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / stage
    steps = logged_steps(run)
    assert [r["step"] for r in steps] == [1, 2]
    if stage == "kto":
        seen = 0
        for record in steps:
            tokens, seen = record["tokens_seen"] - seen, record["tokens_seen"]
            assert all(0 < routed < tokens * 2 for routed in routed_per_layer(record).values()), record
    else:
        assert_counts_match_real_tokens(steps, top_k=2, layers=2)
    with safe_open(str(run / "final" / "adapter" / "adapter_model.safetensors"), "pt") as saved:
        assert any("mlp.experts" in key and "lora_A" in key for key in saved.keys())  # noqa: SIM118


@pytest.mark.slow
def test_moe_settings_on_a_dense_model_stop_the_run_with_exit_2(
    tmp_path: Path, corpus: Path, tokenizer_dir: Path
) -> None:
    model = {"preset": "llama-tiny", "config": SMALL_ARCH, "moe": {"top_k": 2}}
    config = pretrain_config(tmp_path, corpus, tokenizer_dir, model)
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model.moe: llama is not a Mixture-of-Experts model" in result.stderr
    assert "remove model.moe" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_lora_target_parameter_that_matches_nothing_stops_the_run_with_exit_2(
    tmp_path: Path, moe_base: Path
) -> None:
    config = {
        "run": {"name": "lora", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(moe_base)},
        "data": {"train": [{"path": str(ALPACA)}], "max_length": 64, "over_length": "truncate"},
        "train": {
            "stage": "sft",
            "method": "lora",
            "lora": {"target_modules": ["q_proj"], "target_parameters": ["experts.w1"], "dropout": 0},
            "max_steps": 1,
        },
    }
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train.lora.target_parameters: ['experts.w1'] match no parameter" in result.stderr
    assert "experts.gate_up_proj" in result.stderr  # names that do exist


def lora_train(method: str = "lora", **lora: Any) -> TrainConfig:
    return TrainConfig(method=method, lora=LoraConfig(**lora))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lora", "expected"),
    [
        (
            {"target_modules": ["q_proj", "w1", "w3"]},
            r"train.lora.target_modules: \['w1', 'w3'\] match no module of this model; modules here include "
            r".*q_proj.*name them in train.lora.target_parameters \(experts.gate_up_proj, experts.down_proj\)",
        ),
        ({"target_modules": "model[.]nothing[.].*"}, r"train.lora.target_modules: \['model\[.\]nothing"),
        (
            {"target_parameters": ["experts.gate_up_proj"], "dropout": 0.1},
            r"train.lora.dropout=0.1: adapters on parameters \(experts.gate_up_proj\) train without dropout",
        ),
        (
            {"method": "dora"},
            r"train.method: dora has no adapters for parameters \(PEFT\), and this run targets "
            r"experts.down_proj, experts.gate_up_proj",
        ),
    ],
)
def test_lora_targets_and_settings_the_experts_cannot_take_are_refused(
    lora: dict[str, Any], expected: str, tokenizer: PreTrainedTokenizerFast
) -> None:
    base = build_model(
        ModelConfig(preset="mixtral-tiny", config=NARROW["mixtral-tiny"]), tokenizer, max_length=64
    )
    with pytest.raises(UserInputError, match=expected):
        apply_training_method(base, lora_train(**lora))


def test_explicit_target_parameters_with_listed_modules(tokenizer: PreTrainedTokenizerFast) -> None:
    base = build_model(
        ModelConfig(preset="qwen2-moe-tiny", config=NARROW["qwen2-moe-tiny"]), tokenizer, max_length=64
    )
    model = apply_training_method(
        base, lora_train(target_modules=["q_proj"], target_parameters=["experts.down_proj"], dropout=0)
    )
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts.lora_A" in n for n in adapted) and any("q_proj.lora_B" in n for n in adapted)
    assert not any("experts.base_layer" in n or "v_proj" in n or "shared_expert" in n for n in adapted)


@pytest.mark.slow
def test_two_ranks_sum_their_expert_counts(tmp_path: Path, corpus: Path, tokenizer_dir: Path) -> None:
    """DDP on 2 gloo processes: the record holds both ranks' routing (tokens_seen is the global count)."""
    from tests.test_distributed import torchrun

    model = {"preset": "mixtral-tiny", "config": NARROW["mixtral-tiny"]}
    config = pretrain_config(tmp_path, corpus, tokenizer_dir, model)
    config["train"].update(max_steps=2, micro_batch_size=2, grad_accum=1)
    config["distributed"] = {"strategy": "ddp"}
    config["monitor"]["loggers"] = []
    result = torchrun(write_config(tmp_path, config))
    assert result.returncode == 0, result.stderr[-3000:]
    records = logged_steps(tmp_path / "runs" / "moe")
    assert [r["tokens_seen"] for r in records] == [2 * 2 * 32, 4 * 2 * 32]  # 2 ranks x 2 blocks of 32
    assert_counts_match_real_tokens(records, top_k=2, layers=2)
