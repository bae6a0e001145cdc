"""Expert parallelism (transformers' ep_plan and all-to-all token dispatch) with FSDP2 over the data
ranks, on CPU (gloo): distributed/expert_parallel.py.

One 2-process run of tests/dist_scripts/ep_worker.py (expert = data = 2) trains a tiny Qwen2-MoE
(4 experts, top-2, a shared expert) twice: through the engine with a plain AdamW loop against a
whole copy of the model on the whole batch, then through the HF Trainer; a 1-process run of the
same script is the Trainer reference. The tests assert on what the ranks recorded.

Tolerances, from the measured gaps (fp32; the weights, seed and global batch are the single
process's, so only the order of float sums changes: each rank averages its half of the tokens, the
all-to-all hands an expert rows in another order, FSDP2 sums the two halves' gradients):
- loss: at most 9.5e-7 absolute on ~4.5 (2e-7 relative) over 3 engine steps and 3 Trainer steps;
  LOSS_RTOL = 5e-6 leaves a 25x margin, as tests/test_tensor_parallel.py does;
- gradients of the first backward (same weights on both sides): at most 3.5e-7 of the parameter's
  largest reference gradient (k_proj), 3e-8 absolute; GRAD_RTOL = 1e-5 leaves a 30x margin, while
  an expert gradient missing a rank's tokens or divided by the wrong count is off by 50-100%.
  Later steps are compared by their loss only: Adam's update g / sqrt(v) magnifies rounding in
  elements with a tiny v (gaps reach 1e-4 relative after 2 steps) and is blind to a gradient's
  scale, so the Trainer's grad_norm (clipping on, over both meshes) is compared as well.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.distributed.layout import Layout
from tests.conftest import ROOT
from tests.forked_cli import FORK_SERVER
from tests.test_tensor_parallel import LOSS_RTOL, free_port, load_script

SCRIPT = ROOT / "tests" / "dist_scripts" / "ep_worker.py"
GRAD_RTOL = 1e-5
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _worker() -> Any:
    return load_script(SCRIPT)


def _run(out: Path, nproc: int) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port"]
    command = [
        FORK_SERVER.interpreter(),
        *(launcher + [str(free_port())] if nproc > 1 else []),
        str(SCRIPT),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ep")
    return {"single": _run(root / "single", 1), "ep": _run(root / "ep", 2)}


def test_each_rank_stores_half_of_every_expert_weight_and_different_experts(runs: dict[str, Any]) -> None:
    ranks = runs["ep"]
    assert [r["engine"]["held_experts"] for r in ranks] == [[0, 1], [2, 3]]
    for result in ranks:
        shapes = result["engine"]["shapes"]
        experts = {name: shape for name, shape in shapes.items() if name.endswith(EXPERT_WEIGHTS)}
        assert len(experts) == 2 * 2, sorted(shapes)  # 2 layers x (gate_up_proj, down_proj)
        for name, (full, local) in experts.items():
            assert full[0] == 4 and local == [2, *full[1:]], (name, full, local)
        for name, (full, local) in shapes.items():  # the rest stays whole until FSDP2 shards it
            if name not in experts:
                assert local == full, name
        # Under the Trainer, FSDP2 shards the dense parameters over the 2 data ranks; the experts'
        # own FSDP2 unit has one copy of each (efsdp = 1) and leaves their rows as they were.
        trained = result["trainer"]["shapes"]
        assert trained["model.layers.0.self_attn.q_proj.weight"] == [[64, 64], [32, 64]]
        for name, (full, local) in experts.items():
            assert trained[name] == [full, local], name
        assert result["trainer"]["distributed_type"] == "DistributedType.FSDP"


def test_first_loss_and_gradients_equal_one_process(runs: dict[str, Any]) -> None:
    for result in runs["ep"]:
        first = result["engine"]["steps"][0]
        assert math.isclose(first["loss"], first["reference"], rel_tol=LOSS_RTOL)
        gaps = first["grad_gaps"]
        assert any(name.endswith(EXPERT_WEIGHTS) for name in gaps) and "model.embed_tokens.weight" in gaps
        for name, (gap, scale) in gaps.items():
            assert scale > 0 and gap <= GRAD_RTOL * scale, (name, gap, scale)


def test_adamw_steps_keep_the_loss_of_one_process(runs: dict[str, Any]) -> None:
    for result in runs["ep"]:
        steps = result["engine"]["steps"]
        assert len(steps) == 3 and steps[2]["reference"] < steps[0]["reference"]  # it trains
        for step in steps:
            assert math.isclose(step["loss"], step["reference"], rel_tol=LOSS_RTOL), step["loss"]


def test_trainer_losses_and_grad_norms_equal_one_process(runs: dict[str, Any]) -> None:
    reference = runs["single"][0]["trainer"]
    assert sorted(reference["losses"], key=int) == ["1", "2", "3"]
    for result in runs["ep"]:
        trainer = result["trainer"]
        for key in ("losses", "grad_norms"):
            assert trainer[key].keys() == reference[key].keys()
            for step, value in reference[key].items():
                assert math.isclose(trainer[key][step], value, rel_tol=LOSS_RTOL), (key, step)


# -- no processes --------------------------------------------------------------------------------


def test_the_plan_is_transformers_expert_plan_for_every_moe_layer() -> None:
    from lmforge.distributed.expert_parallel import expert_parallel_plan

    model = _worker().tiny_moe()
    plan = expert_parallel_plan(model, Layout(world_size=2, data=2, data_sharded=True, expert=2))
    expected = {}
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp.experts"
        expected |= {f"{prefix}.gate_up_proj": "grouped_gemm", f"{prefix}.down_proj": "grouped_gemm"}
        expected[prefix] = "ep_dispatch_experts"
    assert plan == expected


def test_one_expert_rank_leaves_the_model_alone() -> None:
    from lmforge.distributed.expert_parallel import shard_experts

    model = _worker().tiny_moe()
    before = {name: param.shape for name, param in model.named_parameters()}
    assert shard_experts(model, Layout(world_size=2, data=2, data_sharded=True), on_gpu=False) is None
    assert {name: param.shape for name, param in model.named_parameters()} == before


# -- through `lmforge launch` -------------------------------------------------------------------

MOE_ARCH = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _moe_config(
    out: Path, corpus: Path, name: str, *, micro_batch: int, **distributed: Any
) -> dict[str, Any]:
    from tests.test_tensor_parallel import lmforge_config

    config = lmforge_config(out, corpus, name, micro_batch=micro_batch, steps=4, arch=MOE_ARCH, **distributed)
    # Qwen2-MoE's shared-expert gate ([1, hidden]) is smaller than the data ranks along dim 0:
    # FSDP2 must not leave a rank an empty shard of it (tensor_parallel.no_empty_shards).
    config["model"]["preset"] = "qwen2-moe-tiny"
    config["model"]["config"] = {**MOE_ARCH, "shared_expert_intermediate_size": 32}
    # The load-balancing loss is a function of each rank's own batch (as under any data parallelism):
    # off here, the two data ranks' losses add up to the single process's exactly.
    config["model"]["moe"] = {"router_aux_loss_coef": 0.0}
    return config


# In `make test-integration` (CI time, 37 s): the engine-level runs above keep expert parallelism
# in CI; this one adds lmforge's runner, launch line and metrics around the same engine.
@pytest.mark.integration
def test_lmforge_launch_expert_parallel_matches_one_process(tmp_path: Path, corpus: Path) -> None:
    from lmforge.export.consolidate import consolidate
    from tests.conftest import run_cli
    from tests.test_tensor_parallel import curve, launch, records, write

    single = run_cli(
        "train",
        str(
            write(
                tmp_path / "single.yaml",
                _moe_config(tmp_path, corpus, "single", micro_batch=4, strategy="none"),
            )
        ),
    )
    assert single.returncode == 0, single.stderr[-3000:]
    ep = _moe_config(tmp_path, corpus, "ep", micro_batch=2, strategy="fsdp", expert_parallel=2)
    result = launch(write(tmp_path / "ep.yaml", ep), 2)  # two data ranks of 2 rows: the same global batch
    assert result.returncode == 0, result.stderr[-4000:]
    assert "distributed: fsdp x ep (data_shard=2, expert=2" in result.stderr
    assert "experts split over 2 ranks" in result.stderr
    for key in ("loss", "grad_norm"):
        mine, theirs = curve(tmp_path / "ep", key), curve(tmp_path / "single", key)
        assert sorted(mine) == [1, 2, 3, 4]
        assert all(math.isclose(mine[s], theirs[s], rel_tol=LOSS_RTOL) for s in mine), (key, mine, theirs)
    # The expert-load metrics count every rank's tokens: the same per expert as one process.
    for step in (1, 4):
        mine, theirs = (
            next(r for r in records(tmp_path / run) if r.get("step") == step and "loss" in r)
            for run in ("ep", "single")
        )
        counts = {k: v for k, v in theirs.items() if k.endswith("_tokens") and k.startswith("moe/")}
        assert len(counts) == 2 * 4 and all(mine[k] == v for k, v in counts.items()), (mine, counts)
    # Half the experts per rank (and FSDP2's half of the dense weights): half of every element.
    shares = re.findall(r"rank (\d) holds ([\d,]+) of ([\d,]+) parameter elements", result.stderr)
    assert len(shares) == 2 and all(
        int(h.replace(",", "")) * 2 == int(t.replace(",", "")) for _, h, t in shares
    )
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ep" / "final"))
    assert final.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4  # saved whole
    # The DCP checkpoint holds every expert too: consolidated, it is the final model.
    consolidate(
        tmp_path / "ep" / "checkpoints" / "step-4", tmp_path / "whole", config_dir=tmp_path / "ep" / "final"
    )
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole")).state_dict()
    saved = final.state_dict()
    assert all(torch.equal(whole[k], saved[k]) for k in saved)
    # The step-2 checkpoint resumes the same curve exactly (with an empty shard, accelerate's
    # optimizer held the gate twice and step 4 came out 5.7e-6 off).
    ep["run"]["name"] = "ep-resumed"
    ep["train"]["resume"] = str(tmp_path / "ep" / "checkpoints" / "step-2")
    resumed = launch(write(tmp_path / "ep-resumed.yaml", ep), 2)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    again, straight = curve(tmp_path / "ep-resumed"), curve(tmp_path / "ep")
    assert sorted(again) == [3, 4] and all(again[s] == straight[s] for s in again), (again, straight)


def _ep_plan(processes: int, **sections: dict[str, Any]) -> Any:
    from tests.test_tensor_parallel import config_with, plan_of

    model = {"preset": "qwen3-moe-tiny", "config": MOE_ARCH}
    return plan_of(config_with(model, {"strategy": "fsdp", "expert_parallel": 2}, **sections), processes)


def test_what_expert_parallelism_cannot_run_is_refused_with_every_reason() -> None:
    from lmforge.errors import UserInputError

    with pytest.raises(UserInputError) as refused:
        _ep_plan(2, distributed={"strategy": "ddp"}, train={"stage": "dpo"})
    message = str(refused.value)
    assert (
        "distributed.strategy: ddp with expert_parallel: 2" in message
        and "set distributed.strategy: fsdp" in message
    )
    assert "train.stage: dpo with expert_parallel: 2" in message
    with pytest.raises(UserInputError, match="expert_parallel: 2 with tensor_parallel: 2"):
        _ep_plan(4, distributed={"tensor_parallel": 2})
    with pytest.raises(UserInputError, match=r"expert_parallel: 2 must divide the data ranks \(3 of 3\)"):
        _ep_plan(3)
    with pytest.raises(UserInputError, match="'llama' is a dense model"):
        _ep_plan(2, model={"preset": "llama-tiny", "config": {}})
    plan = _ep_plan(4, distributed={"strategy": "auto"})
    assert plan.engine == "fsdp" and plan.summary()["layout"]["expert"] == 2
