"""Resharding resume: a checkpoint written by 2 processes resumes under 4 and under 1, on real
engines (torch DCP through accelerate's FSDP2 path, DeepSpeed's universal checkpoint), gloo on CPU;
a single-process checkpoint resumes on 2 FSDP2 (+ TP) processes and on 2 ZeRO-1/2/3 processes.

Each engine trains 2 processes x 2 sequences for STEPS steps with a checkpoint at step SAVED, without
interruption: that is the reference curve. Runs of another world size resume from its step-SAVED
checkpoint with the same global batch of 4 sequences (4 processes x 1; 1 process x 2 x 2 accumulated)
and must continue the same curve at steps SAVED+1..STEPS.

Tolerance: the same samples make up each global batch (accelerate's seeded sampler orders the data
independently of the world size, and HF skips SAVED x global batch samples of it), and the same
global-token-mean gradient is computed, but summed in another order (per-rank partial sums, then
all-reduces over another number of ranks), so fp32 results differ by rounding that Adam amplifies.
Measured here: at most 1e-6 absolute on a loss of ~5 (FSDP 2 -> 4, ZeRO-2 2 -> 4), the others exactly
equal. RELATIVE (1e-5 of the loss, ~5e-5) leaves a margin over rounding and is a thousand times
smaller than one step's loss change (0.05-0.2): a batch of other samples, a lost optimizer moment or a
wrong step count shows (DeepSpeed's ZeRO-3 universal load, which advanced one shared Adam step counter
per parameter sub-group, left the curve by 6e-5 and 3e-3 before lmforge split the counters).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lmforge.ckpt.reshard_states import rng_stand_in
from lmforge.ckpt.universal import _universal_arguments, universal_dir
from lmforge.distributed.reshard import resume_path
from lmforge.errors import UserInputError
from tests.test_distributed import base_config, held_shares, torchrun, write

STEPS = 6
SAVED = 3
RELATIVE = 1e-5


def records(run_dir: Path) -> dict[int, dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def reference_run(out: Path, corpus: Path, name: str, **distributed: Any) -> tuple[dict, Path]:
    """2 processes, STEPS steps, checkpoints at SAVED and STEPS: the uninterrupted curve."""
    config = base_config(out, corpus, name, micro_batch=2, **distributed)
    config["train"] |= {"max_steps": STEPS, "save_every": SAVED}
    result = torchrun(write(out / f"{name}.yaml", config))
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(records(out / name)) == list(range(1, STEPS + 1))
    return config, out / name / "checkpoints" / f"step-{SAVED}"


def resume(
    config: dict, checkpoint: Path, name: str, *, nproc: int, micro_batch: int, grad_accum: int = 1
) -> Any:
    """A new run that resumes `checkpoint` on `nproc` processes with the same global batch."""
    out = Path(config["run"]["output_dir"])
    resumed = json.loads(json.dumps(config))
    resumed["run"]["name"] = name
    resumed["train"] |= {"micro_batch_size": micro_batch, "grad_accum": grad_accum, "resume": str(checkpoint)}
    assert micro_batch * grad_accum * nproc == 2 * 2  # the reference's global batch
    return torchrun(write(out / f"{name}.yaml", resumed), nproc=nproc)


def assert_continues(reference: Path, resumed: Path) -> float:
    """Steps SAVED+1..STEPS of `resumed` are the reference's: the loss to RELATIVE, and the data
    position (epoch, tokens seen) exactly. Returns the largest relative loss difference."""
    ref, again = records(reference), records(resumed)
    assert sorted(again) == list(range(SAVED + 1, STEPS + 1))
    worst = max(abs(again[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in again)
    assert worst < RELATIVE, ({s: again[s]["loss"] for s in again}, {s: ref[s]["loss"] for s in again})
    for step in again:
        assert again[step]["tokens_seen"] == ref[step]["tokens_seen"]
        assert again[step]["epoch"] == pytest.approx(ref[step]["epoch"])
        assert again[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-12)
    return worst


# ---- which path applies (no processes) ----

FSDP2 = {"engine": "fsdp", "world_size": 2, "zero_stage": None}
ZERO2 = {"engine": "deepspeed", "world_size": 2, "zero_stage": 2}


@pytest.mark.parametrize(
    ("writer", "now", "kind"),
    [
        (FSDP2, {"engine": "fsdp", "world_size": 2, "zero_stage": None}, "same"),
        (FSDP2, {"engine": "fsdp", "world_size": 4, "zero_stage": None}, "dcp_reshard"),
        (FSDP2, {"engine": "none", "world_size": 1, "zero_stage": None}, "dcp_to_plain"),
        (FSDP2, {"engine": "ddp", "world_size": 4, "zero_stage": None}, "dcp_to_plain"),
        (ZERO2, {"engine": "deepspeed", "world_size": 1, "zero_stage": 2}, "deepspeed_universal"),
        (ZERO2, {"engine": "deepspeed", "world_size": 2, "zero_stage": 2}, "same"),
        (
            {"engine": "ddp", "world_size": 2},
            {"engine": "fsdp", "world_size": 4, "zero_stage": None},
            "whole",
        ),
        (None, {"engine": "ddp", "world_size": 4, "zero_stage": None}, "whole"),
        (None, {"engine": "deepspeed", "world_size": 4, "zero_stage": 3}, "deepspeed_universal"),
        (
            {"engine": "none", "world_size": 1},
            {"engine": "deepspeed", "world_size": 2, "zero_stage": 1},
            "deepspeed_universal",
        ),
        (
            {"engine": "ddp", "world_size": 2},
            {"engine": "deepspeed", "world_size": 4, "zero_stage": 3},
            "deepspeed_universal",
        ),
        (
            {"engine": "none", "world_size": 1},
            {"engine": "fsdp", "world_size": 2, "zero_stage": None, "tensor_parallel": 2},
            "whole",
        ),
    ],
)
def test_each_change_of_world_has_its_resume_path(writer: dict | None, now: dict, kind: str) -> None:
    assert resume_path(Path("ckpt"), writer, now).kind == kind


@pytest.mark.parametrize(
    ("writer", "now", "said"),
    [
        (ZERO2, {"engine": "deepspeed", "world_size": 2, "zero_stage": 3},
         "not another ZeRO stage (it keeps its stage's layout: a ZeRO-3 engine reads zero_pp_rank_*"),
        (ZERO2, {"engine": "fsdp", "world_size": 2, "zero_stage": None},
         "it holds DeepSpeed's ZeRO partitions, which fsdp does not load"),
        (FSDP2, {"engine": "deepspeed", "world_size": 2, "zero_stage": 2},
         "it holds torch DCP shards, which deepspeed does not load"),
    ],
)  # fmt: skip
def test_another_engine_or_zero_stage_is_refused_with_the_way_forward(
    writer: dict, now: dict, said: str
) -> None:
    with pytest.raises(UserInputError) as refused:
        resume_path(Path("runs/a/checkpoints/step-3"), writer, now)
    message = str(refused.value)
    assert said in message and "(on any number of processes)" in message
    assert "lmforge ckpt consolidate runs/a/checkpoints/step-3 --out DIR" in message
    fix = (
        "distributed.zero_stage=2"
        if now["engine"] == writer["engine"]
        else f"distributed.strategy={writer['engine']}"
    )
    assert fix in message


def test_ranks_of_another_world_continue_a_writer_ranks_rng_state(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"rng_state_{rank}.pth").write_bytes(b"")
    assert rng_stand_in(tmp_path, rank=0, world_size=1) == tmp_path / "rng_state_0.pth"
    assert rng_stand_in(tmp_path, rank=3, world_size=4) == tmp_path / "rng_state_1.pth"
    assert rng_stand_in(tmp_path, rank=1, world_size=2) is None  # HF finds its own file
    assert rng_stand_in(tmp_path / "none", rank=0, world_size=1) is None


def test_the_universal_conversion_passes_every_option_of_deepspeeds_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deepspeed.checkpoint import ds_to_universal

    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", "a", "--output_folder", "b"])
    theirs = vars(ds_to_universal.parse_arguments())
    assert sorted(vars(_universal_arguments(Path("a"), Path("b")))) == sorted(theirs)


def test_deepspeed_zero3_universal_load_still_shares_one_step_counter() -> None:
    """lmforge splits the counters after a ZeRO-3 universal load (reshard.separate_step_counters).
    When this fails, DeepSpeed changed that load: check whether the split is still needed."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    )
    assert "self.optimizer.state[fp32_param]['step'] = state_step" in source


def test_deepspeed_zero3_universal_load_still_gives_every_group_group_0s_settings() -> None:
    """lmforge restores each group's settings after a ZeRO-3 universal load
    (reshard.restore_group_settings). When this fails, DeepSpeed changed that load: check whether the
    restore is still needed."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3
    )
    assert 'optim_sd[OPTIMIZER_STATE_DICT]["param_groups"][0].items()' in source


# ---- one process -> FSDP2 (with and without tensor parallelism) ----


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[dict, Path]:
    """One process, 1 x 4 sequences, STEPS steps with a checkpoint at SAVED: the curve a resume on 2
    processes must continue. The tensor-parallel test's heads (4 query, 2 key/value) split over 2."""
    from tests.conftest import run_cli
    from tests.test_tensor_parallel import TP_ARCH

    out = tmp_path_factory.mktemp("single")
    config = base_config(out, corpus, "single", micro_batch=4, strategy="none")
    config["model"]["config"] = TP_ARCH
    # Weight decay: the no-decay group (norms) must keep its own settings through every resume path.
    config["train"] |= {"max_steps": STEPS, "save_every": SAVED, "weight_decay": 0.5}
    result = run_cli("train", str(write(out / "single.yaml", config)), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return config, out / "single" / "checkpoints" / f"step-{SAVED}"


@pytest.mark.parametrize(
    ("name", "distributed", "micro_batch", "held"),
    [
        ("fsdp-on-2", {"strategy": "fsdp"}, 2, 0.5),
        # 2-D mesh data_shard=1 x tensor=2: one data-parallel process takes the whole global batch.
        ("fsdp-tp-on-2", {"strategy": "fsdp", "tensor_parallel": 2}, 4, 0.5),
    ],
)
def test_a_single_process_checkpoint_resumes_on_2_fsdp_processes(
    single_reference: tuple[dict, Path], name: str, distributed: dict, micro_batch: int, held: float
) -> None:
    """Whole states (model.safetensors, optimizer.pt) into FSDP2's sharded parameters and moments:
    accelerate's FSDP2 load read only DCP shards and every rank ended in `metadata is None`."""
    config, checkpoint = single_reference
    out = Path(config["run"]["output_dir"])
    resumed = json.loads(json.dumps(config))
    resumed["run"]["name"] = name
    resumed["distributed"] = distributed
    resumed["train"] |= {"micro_batch_size": micro_batch, "resume": str(checkpoint)}
    result = torchrun(write(out / f"{name}.yaml", resumed))
    assert result.returncode == 0, result.stderr[-4000:]
    assert_continues(out / "single", out / name)
    assert (
        f"resuming the whole model and optimizer of {checkpoint}: each rank keeps its shards" in result.stderr
    )
    shares = held_shares(result.stderr)  # really sharded: each rank holds half
    assert sorted(shares) == [0, 1] and all(abs(v - held) < 0.01 for v in shares.values()), shares


@pytest.mark.parametrize(
    "stage",
    [3, pytest.param(1, marks=pytest.mark.integration), pytest.param(2, marks=pytest.mark.integration)],
)
def test_a_single_process_checkpoint_resumes_on_2_deepspeed_processes(
    single_reference: tuple[dict, Path], stage: int
) -> None:
    """Whole states (model.safetensors, optimizer.pt) written as DeepSpeed's universal checkpoint:
    DeepSpeed loaded only its own global_step*/ checkpoints and lmforge refused with exit 2. The
    universal form goes into the run being trained, not into the run resumed from."""
    config, checkpoint = single_reference
    out = Path(config["run"]["output_dir"])
    name = f"single-as-zero{stage}"
    before = sorted(p.name for p in checkpoint.parent.iterdir())
    resumed = json.loads(json.dumps(config))
    resumed["run"]["name"] = name
    resumed["distributed"] = {"strategy": "deepspeed", "zero_stage": stage}
    resumed["train"] |= {"micro_batch_size": 2, "resume": str(checkpoint)}
    result = torchrun(write(out / f"{name}.yaml", resumed))
    assert result.returncode == 0, result.stderr[-4000:]
    assert_continues(out / "single", out / name)
    assert (
        f"one process as deepspeed ZeRO-{stage} on 2 process(es): through DeepSpeed's universal"
        in result.stderr
    )
    said = [line for line in result.stderr.splitlines() if "to a universal checkpoint at" in line]
    target = universal_dir(checkpoint, out / name / "checkpoints" / ".staging")
    assert len(said) == 1 and str(target) in said[0] and "converted whole-state checkpoint" in said[0], said
    assert not target.exists()  # derived data, removed when the launch ended
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == before  # the other run is untouched
    if stage == 3:
        shares = held_shares(result.stderr)  # really partitioned: each rank holds half
        assert sorted(shares) == [0, 1] and all(abs(v - 0.5) < 0.01 for v in shares.values()), shares


# ---- FSDP2: torch DCP ----


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[dict, Path]:
    return reference_run(tmp_path_factory.mktemp("fsdp"), corpus, "fsdp", strategy="fsdp")


def test_an_fsdp_checkpoint_of_2_processes_resumes_on_4(fsdp_reference: tuple[dict, Path]) -> None:
    config, checkpoint = fsdp_reference
    result = resume(config, checkpoint, "fsdp-on-4", nproc=4, micro_batch=1)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "fsdp", out / "fsdp-on-4")
    assert (
        "fsdp on 2 process(es) as fsdp on 4 process(es): torch DCP reshards it as it loads" in result.stderr
    )
    shares = held_shares(result.stderr)  # really FSDP on 4: each rank holds a quarter
    assert sorted(shares) == [0, 1, 2, 3] and all(abs(v - 0.25) < 0.01 for v in shares.values()), shares


def test_an_fsdp_checkpoint_of_2_processes_resumes_in_one(fsdp_reference: tuple[dict, Path]) -> None:
    """One process is no FSDP (lmforge trains it as a plain process): the DCP shards load into the
    whole model and optimizer by parameter name; rank 0's RNG state continues."""
    config, checkpoint = fsdp_reference
    result = resume(config, checkpoint, "fsdp-in-1", nproc=1, micro_batch=2, grad_accum=2)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "fsdp", out / "fsdp-in-1")
    assert (
        "fsdp on 2 process(es) as one process: its torch DCP shards load into the whole model"
        in result.stderr
    )
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "fsdp-in-1" / "final")


@pytest.mark.integration
def test_an_fsdp_checkpoint_resumes_under_ddp(fsdp_reference: tuple[dict, Path]) -> None:
    config, checkpoint = fsdp_reference
    config = json.loads(json.dumps(config))
    config["distributed"] = {"strategy": "ddp"}
    result = resume(config, checkpoint, "fsdp-as-ddp", nproc=2, micro_batch=2)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "fsdp", out / "fsdp-as-ddp")


# ---- DeepSpeed ZeRO: the universal checkpoint ----


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("zero3")
    return reference_run(out, corpus, "zero3", strategy="deepspeed", zero_stage=3)


def test_a_zero3_checkpoint_of_2_processes_resumes_in_one_through_the_universal_checkpoint(
    zero3_reference: tuple[dict, Path],
) -> None:
    config, checkpoint = zero3_reference
    result = resume(config, checkpoint, "zero3-in-1", nproc=1, micro_batch=2, grad_accum=2)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "zero3", out / "zero3-in-1")
    said = [line for line in result.stderr.splitlines() if "to a universal checkpoint at" in line]
    target = universal_dir(checkpoint, out / "zero3-in-1" / "checkpoints" / ".staging")
    assert len(said) == 1 and str(target) in said[0] and "converted DeepSpeed checkpoint" in said[0], said
    assert not target.exists()  # derived data, removed when the launch ended
    assert not list(checkpoint.parent.glob("*universal*"))  # nothing written into the run resumed from
    resolved = json.loads((out / "zero3-in-1" / "deepspeed_config.json").read_text())
    assert resolved["checkpoint"] == {"load_universal": True}


@pytest.mark.integration
def test_a_zero3_checkpoint_of_2_processes_resumes_on_4(zero3_reference: tuple[dict, Path]) -> None:
    config, checkpoint = zero3_reference
    result = resume(config, checkpoint, "zero3-on-4", nproc=4, micro_batch=1)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "zero3", out / "zero3-on-4")
    shares = held_shares(result.stderr)
    assert sorted(shares) == [0, 1, 2, 3] and all(abs(v - 0.25) < 0.01 for v in shares.values()), shares


@pytest.fixture(scope="module")
def zero2_reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("zero2")
    return reference_run(out, corpus, "zero2", strategy="deepspeed", zero_stage=2)


@pytest.mark.integration
@pytest.mark.parametrize(("nproc", "micro_batch", "grad_accum"), [(1, 2, 2), (4, 1, 1)])
def test_a_zero2_checkpoint_of_2_processes_resumes_under_another_world_size(
    zero2_reference: tuple[dict, Path], nproc: int, micro_batch: int, grad_accum: int
) -> None:
    config, checkpoint = zero2_reference
    name = f"zero2-on-{nproc}"
    result = resume(config, checkpoint, name, nproc=nproc, micro_batch=micro_batch, grad_accum=grad_accum)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(config["run"]["output_dir"])
    assert_continues(out / "zero2", out / name)
