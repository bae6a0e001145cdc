"""Host syncs of lmforge's own code per optimizer step, measured on a TRL stage (DPO) and on
language-model pretraining. train/step.py's docstring says: none before the update at a step that
is not logged (the guardrails' verdict is computed on the device and the optimizer drops a bad
update by a device flag); the step's numbers are read at the next step's close from a copy made
when it closed (on a GPU: pinned memory behind an event, so nothing queued later is waited for).
A logged step reads more (its record: the update ratio, HF's logged loss).

On CPU there is no device to wait for, so the test counts what would be a sync on a GPU: calls of
Tensor.item / .tolist / .cpu / .numpy / __bool__ / __float__ / __int__ / __index__ made from a file
under src/lmforge (the calling frame's file and function), during training only (after
on_train_begin, before on_train_end)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

import lmforge
from lmforge.config import load_config
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.train.runner import run_training
from tests.conftest import ROOT, SMALL_ARCH, save_tiny_llama

SOURCE = str(Path(lmforge.__file__).parent)
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
PREFERENCE = ROOT / "examples" / "data" / "arithmetic_preference.jsonl"
STEPS, ACCUMULATION = 5, 2


class SyncCounter(TrainerCallback):
    """Counts lmforge's host syncs by optimizer step and calling site while the Trainer trains."""

    def __init__(self) -> None:
        self.sites: dict[int, Counter[str]] = {}
        self.logged: set[int] = set()
        self.step = 0
        self.on = False

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.on = True

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step + 1

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logged.add(state.global_step)

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self.on = False

    @contextmanager
    def counting(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

        def wrap(name: str, original: Any) -> Any:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                caller = sys._getframe(1).f_code.co_filename
                if self.on and caller.startswith(SOURCE):
                    frame = sys._getframe(1)
                    site = f"{Path(caller).relative_to(SOURCE)}:{frame.f_code.co_name} {name}"
                    self.sites.setdefault(self.step, Counter())[site] += 1
                return original(tensor, *args, **kwargs)

            return counted

        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def assert_no_sync_before_an_unlogged_update(config: dict[str, Any]) -> None:
    counter = SyncCounter()
    with counter.counting():
        outcome = run_training(load_config(None, base=config), extra_callbacks=[counter])
    assert outcome.steps == STEPS
    unlogged = [step for step in range(1, STEPS + 1) if step not in counter.logged]
    assert len(unlogged) >= 2, f"logged steps {sorted(counter.logged)}: nothing to measure"
    for step in unlogged:
        syncs = counter.sites.get(step, Counter())
        # At most one read, of the previous step's copy (none after a logged step, read when logged).
        assert set(syncs) <= {"train/step.py:read tolist"} and sum(syncs.values()) <= 1, (
            f"step {step} of {STEPS} (accumulation {ACCUMULATION}): {dict(syncs)}"
        )
    reads = [step for step in unlogged if counter.sites.get(step)]
    assert reads == [step for step in unlogged if step - 1 in unlogged], counter.sites


def _train() -> dict[str, Any]:
    # log_every beyond the run: HF logs the first and the last step only; the steps between are measured.
    return {
        "max_steps": STEPS,
        "micro_batch_size": 2,
        "grad_accum": ACCUMULATION,
        "lr": 1e-3,
        "precision": "fp32",
        "log_every": 1000,
        "save_every": 1000,
    }


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = PREFERENCE.read_text().splitlines()
    tokenizer = train_tokenizer(texts * 2, TokenizerTrainConfig(vocab_size=400, min_frequency=1))
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("base") / "model")


def test_a_trl_stage_waits_for_no_step_before_its_update(tmp_path: Path, base_model: Path) -> None:
    config = {
        "run": {"name": "dpo", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base_model)},
        "data": {"train": [{"path": str(PREFERENCE)}], "max_length": 64, "over_length": "truncate"},
        "train": {"stage": "dpo", **_train()},
        "monitor": {"loggers": []},
    }
    assert_no_sync_before_an_unlogged_update(config)


def test_pretraining_waits_for_no_step_before_its_update(tmp_path: Path, corpus: Path) -> None:
    config = {
        "run": {"name": "pretrain", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64, "eval_fraction": 0},
        "train": _train(),
        "monitor": {"loggers": []},
    }
    assert_no_sync_before_an_unlogged_update(config)


def test_mask_tokens_keeps_the_count_on_the_masks_device() -> None:
    """On the "meta" device, where nothing can be copied to the host: a `.cpu()` would raise."""
    from lmforge.train.batches import mask_tokens

    preference = {
        "prompt_attention_mask": torch.ones(2, 3, device="meta"),
        "chosen_attention_mask": torch.ones(2, 5, device="meta", dtype=torch.int64),
        "rejected_attention_mask": torch.ones(2, 4, device="meta", dtype=torch.int64),
    }
    online = {
        "prompt_mask": torch.ones(2, 3, device="meta"),
        "completion_mask": torch.ones(2, 6, device="meta"),
    }
    assert mask_tokens(preference).device.type == "meta"
    assert mask_tokens(online).device.type == "meta"
    masks = {
        "chosen_attention_mask": torch.ones(2, 5, dtype=torch.int64),
        "prompt_attention_mask": torch.ones(2, 3),
    }
    assert int(mask_tokens(masks)) == 10  # prompt masks are parts of the sequences, not counted again
