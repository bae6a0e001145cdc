"""Pipeline parallelism (torch.distributed.pipelining's schedules over HF decoder stages) through
the HF Trainer on CPU (gloo): distributed/pipeline_parallel.py.

A tiny 4-layer Llama with a tied embedding is trained four steps by one process (the reference),
by two pipeline stages (`lmforge launch`, 1F1B, two pipeline micro-batches per micro-batch) and by
interleaved 1F1B (four stages of one layer on two ranks);
the stages' checkpoint then resumes both on two stages and on one process (DCP reshards the
stages' distinct keys into the whole model). Heavier layouts (FSDP2 x pipeline on 4 processes,
GPipe with 4 micro-batches) run under `make test-integration`.

Tolerance: the global batch, seed and data are the same as the single process. The last stage
sums token cross-entropies per pipeline micro-batch and divides by the step's token count, so
the loss and gradient are the whole micro-batch's up to the order of float sums (measured: loss
within 1e-6 of ~5.7 (2e-7 relative) over 4 steps, eval loss within 5e-7, gradient norms within 6e-7). LOSS_RTOL
(5e-6) is the tensor-parallel tests' bound: a stage reading another batch, a loss divided by the
micro-batch count twice, a tied embedding whose two copies drift apart, or a gradient norm of one
stage only would all show at the first steps (the lr makes each step move the loss by 0.2-0.3).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.errors import UserInputError
from tests.conftest import run_cli
from tests.test_tensor_parallel import LOSS_RTOL, config_with, curve, launch, lmforge_config, plan_of, write

ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def config(out: Path, corpus: Path, name: str, **distributed: Any) -> dict[str, Any]:
    """Four steps of micro-batch 4 (llama-tiny ties its embedding and head), as the TP tests train."""
    return lmforge_config(out, corpus, name, micro_batch=4, steps=4, arch=ARCH, **distributed)


def records(run_dir: Path, key: str) -> dict[int, float]:
    return curve(run_dir, key)


def assert_same_curve(run_dir: Path, reference: Path, steps: list[int], *, keys: tuple[str, ...]) -> None:
    for key in keys:
        mine, theirs = records(run_dir, key), records(reference, key)
        assert sorted(s for s in mine if s > 0) == steps, (key, mine)
        for step in steps:
            if step in mine:
                assert math.isclose(mine[step], theirs[step], rel_tol=LOSS_RTOL), (key, step, mine, theirs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, Any]:
    """single/ (one process) and pp/ (two stages); the stderr of the pipeline launch."""
    out = tmp_path_factory.mktemp("pp")
    single = run_cli("train", str(write(out / "single.yaml", config(out, corpus, "single", strategy="none"))))
    assert single.returncode == 0, single.stderr[-3000:]
    staged = launch(
        write(out / "pp.yaml", config(out, corpus, "pp", strategy="fsdp", pipeline_parallel=2)), 2
    )
    assert staged.returncode == 0, staged.stderr[-4000:]
    return {"out": out, "corpus": corpus, "stderr": staged.stderr}


def test_two_stages_train_the_same_curve_as_one_process(runs: dict[str, Any]) -> None:
    out = runs["out"]
    assert (
        "distributed: pp (2-D mesh data_shard=1 x pipeline=2; schedule 1f1b, 2 pipeline micro-batches per "
        "micro-batch) on 2 process(es)" in runs["stderr"]
    )
    assert_same_curve(out / "pp", out / "single", [1, 2, 3, 4], keys=("loss", "grad_norm"))
    assert_same_curve(out / "pp", out / "single", [2, 4], keys=("eval_loss",))
    # Each stage reads the whole batch, and the tokens are counted once per pipeline.
    for step in ("step-2", "step-4"):
        seen = [
            json.loads((out / run / "checkpoints" / step / "trainer_state.json").read_text())[
                "num_input_tokens_seen"
            ]
            for run in ("pp", "single")
        ]
        assert seen[0] == seen[1], (step, seen)


def test_each_stage_holds_only_its_layers(runs: dict[str, Any]) -> None:
    stages = dict(
        re.findall(
            r"rank (\d) of 2 in its pipeline \(1 stage\(s\) each\) holds ([\d,]+) parameter", runs["stderr"]
        )
    )
    held = {int(k): int(v.replace(",", "")) for k, v in stages.items()}
    # Two of the 4 layers per stage; the embedding on stage 1 and, tied to the head, on stage 2 too;
    # the final norm (64) on stage 2.
    whole = AutoModelForCausalLM.from_pretrained(str(runs["out"] / "single" / "final"))
    per_layer = sum(p.numel() for p in whole.model.layers[0].parameters())
    embedding = whole.model.embed_tokens.weight.numel()
    assert held == {1: 2 * per_layer + embedding, 2: 2 * per_layer + embedding + 64}, (held, per_layer)
    total = sum(p.numel() for p in whole.parameters())
    shares = re.findall(r"rank (\d) holds ([\d,]+) of ([\d,]+) parameter elements", runs["stderr"])
    assert {int(r) for r, _, _ in shares} == {0, 1}
    assert all(int(of.replace(",", "")) == total for _, _, of in shares)  # the whole model, not a stage


def test_the_final_model_is_one_shard_per_stage_and_loads_whole(runs: dict[str, Any]) -> None:
    final, reference = runs["out"] / "pp" / "final", runs["out"] / "single" / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert index["model.layers.1.mlp.up_proj.weight"] == "model-00001-of-00002.safetensors"
    assert index["model.layers.2.mlp.up_proj.weight"] == "model-00002-of-00002.safetensors"
    assert index["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert "lm_head.weight" not in index  # tied: written once, from_pretrained ties it back
    second = load_file(str(final / "model-00002-of-00002.safetensors"))
    assert "model.norm.weight" in second and "model.embed_tokens.weight" not in second
    mine = AutoModelForCausalLM.from_pretrained(str(final)).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(str(reference)).state_dict()
    assert sorted(mine) == sorted(theirs)
    worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    assert worst < 1e-4, worst  # 4 AdamW steps at lr 3e-3: the same weights up to float sums
    finished = json.loads((final / "lmforge_finished.json").read_text())
    assert finished["parameters"] == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(str(final)).parameters()
    )


def test_the_stages_checkpoint_resumes_on_two_stages_and_on_one_process(runs: dict[str, Any]) -> None:
    out, corpus = runs["out"], runs["corpus"]
    checkpoint = out / "pp" / "checkpoints" / "step-2"
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):  # both stages wrote their part (torch DCP)
        assert sorted(p.name for p in (checkpoint / name).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    staged = config(out, corpus, "pp-resumed", strategy="fsdp", pipeline_parallel=2)
    staged["train"]["resume"] = str(checkpoint)
    result = launch(write(out / "pp-resumed.yaml", staged), 2)
    assert result.returncode == 0, result.stderr[-4000:]
    alone = config(out, corpus, "pp-to-one", strategy="none")
    alone["train"]["resume"] = str(checkpoint)
    result = run_cli("train", str(write(out / "pp-to-one.yaml", alone)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "its torch DCP shards load into the whole model and optimizer" in result.stderr
    for run in ("pp-resumed", "pp-to-one"):
        assert_same_curve(out / run, out / "single", [3, 4], keys=("loss",))


def test_interleaved_1f1b_runs_two_stages_per_rank_and_matches_one_process(runs: dict[str, Any]) -> None:
    out = runs["out"]
    settings = config(out, runs["corpus"], "interleaved", strategy="fsdp", pipeline_parallel=2)
    settings["distributed"] |= {"pipeline_schedule": "interleaved_1f1b", "pipeline_microbatches": 4}
    result = launch(write(out / "interleaved.yaml", settings), 2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 1 of 2 in its pipeline (2 stage(s) each)" in result.stderr
    assert "schedule interleaved_1f1b, 4 pipeline micro-batches per micro-batch" in result.stderr
    assert_same_curve(out / "interleaved", out / "single", [1, 2, 3, 4], keys=("loss", "grad_norm"))
    # 4 stages of one layer: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3 (torch's loop order).
    index = json.loads((out / "interleaved" / "final" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    held = {int(k.split(".")[2]): v for k, v in index.items() if k.endswith("self_attn.q_proj.weight")}
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert held == {0: first, 1: second, 2: first, 3: second}, held


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "processes", "micro_batch", "distributed"),
    [
        ("fsdp-pp", 4, 2, {"strategy": "fsdp", "pipeline_parallel": 2}),
        ("gpipe", 2, 4, {"strategy": "fsdp", "pipeline_parallel": 2, "pipeline_schedule": "gpipe",
                         "pipeline_microbatches": 4}),
    ],
)  # fmt: skip
def test_other_pipeline_layouts_match_one_process(
    runs: dict[str, Any], name: str, processes: int, micro_batch: int, distributed: dict[str, Any]
) -> None:
    out = runs["out"]
    settings = config(out, runs["corpus"], name, **distributed)
    settings["train"]["micro_batch_size"] = micro_batch  # 4 x 1 or 2 x 2: the single run's global batch
    result = launch(write(out / f"{name}.yaml", settings), processes)
    assert result.returncode == 0, result.stderr[-4000:]
    # Two data ranks batch the eval rows differently (a mean of per-batch means): training curve only.
    assert_same_curve(out / name, out / "single", [1, 2, 3, 4], keys=("loss",))


# -- refusals: no processes ---------------------------------------------------------------------


def _plan(processes: int, **sections: dict[str, Any]) -> Any:
    model = {"preset": "llama-tiny", "config": ARCH}
    return plan_of(config_with(model, {"strategy": "fsdp", "pipeline_parallel": 2}, **sections), processes)


def test_what_the_pipeline_cannot_run_is_refused_with_every_reason() -> None:
    with pytest.raises(UserInputError) as refused:
        _plan(
            2,
            distributed={"strategy": "ddp", "pipeline_microbatches": 1},
            train={
                "stage": "dpo",
                "precision": "fp16",
                "chunked_cross_entropy": True,
                "micro_batch_size": 1,
                "compile": "layers",
            },
        )
    message = str(refused.value)
    for expected in (
        "distributed.strategy: ddp with pipeline_parallel: 2",
        "train.stage: dpo with pipeline_parallel: 2",
        "train.precision: fp16 with pipeline_parallel: 2",
        "train.chunked_cross_entropy: true with pipeline_parallel: 2",
        "train.compile: layers with pipeline_parallel: 2",
        "1f1b needs one micro-batch per stage",
    ):
        assert expected in message, (expected, message)
    with pytest.raises(
        UserInputError, match="micro_batch_size: 1 is smaller than the 2 pipeline micro-batches"
    ):
        _plan(2, train={"micro_batch_size": 1})
    plan = _plan(4, distributed={"strategy": "auto"})
    assert plan.engine == "fsdp" and plan.describe_engine() == (
        "fsdp x pp (2-D mesh data_shard=2 x pipeline=2; schedule 1f1b, 2 pipeline micro-batches per micro-batch)"
    )
    interleaved = {"pipeline_schedule": "interleaved_1f1b", "pipeline_microbatches": 4}
    assert (
        "schedule interleaved_1f1b, 4 pipeline micro-batches" in _plan(2, distributed=interleaved).describe()
    )
    assert plan.summary()["layout"]["pipeline"] == 2


def test_a_batch_runs_on_the_configured_schedule_or_the_log_names_the_other() -> None:
    """interleaved_1f1b used to become ScheduleLoopedBFS without a word; a configured micro-batch
    count it cannot take is now refused at load (tests/test_layout.py), and a short last batch that
    still cannot take it is named in the log."""
    from lmforge.distributed.pipeline_parallel import _schedule_class, schedule_note

    full = _schedule_class("interleaved_1f1b", 4, 2)
    assert full.__name__ == "ScheduleInterleaved1F1B"
    assert schedule_note("interleaved_1f1b", full, rows=4, chunks=4, ranks=2) is None
    short = _schedule_class("interleaved_1f1b", 3, 2)  # the last batch of an epoch: 3 rows
    note = schedule_note("interleaved_1f1b", short, rows=3, chunks=3, ranks=2)
    assert note is not None and "interleaved_1f1b cannot take over 2 ranks" in note
    assert "ScheduleLoopedBFS runs this batch" in note


def test_a_flat_optimizer_checkpoint_is_told_apart(runs: dict[str, Any]) -> None:
    from lmforge.ckpt.reshard_states import DCP_OPTIMIZER_DIR, dcp_optimizer_is_flat

    assert dcp_optimizer_is_flat(runs["out"] / "pp" / "checkpoints" / "step-2" / DCP_OPTIMIZER_DIR)
    torch.manual_seed(0)  # the accelerate format (FSDP2 alone) keys group settings by position
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    target = runs["out"] / "positional" / DCP_OPTIMIZER_DIR
    dcp.save(
        {"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(target), no_dist=True
    )
    assert not dcp_optimizer_is_flat(target)
