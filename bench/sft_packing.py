"""SFT throughput: lmforge packing vs HF Trainer padding to the longest, random order.

Same tiny llama (fp32, sdpa), same tokenized samples (heavy-tailed lengths), same real-token
budget per optimizer step, in one process. The baseline is HF Trainer with
`DataCollatorForSeq2Seq(padding="longest", label_pad_token_id=-100)`: DataCollatorWithPadding
pads to the longest the same way but cannot pad `labels`, which causal-LM SFT needs.
lmforge: best-fit packed rows of `max_length` with a block-diagonal mask. Both count real
(non-pad) tokens exactly; runs alternate baseline, lmforge, baseline, lmforge.

    .venv/bin/python bench/sft_packing.py [--rows 3000 --steps 30 --warmup 5 --repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from synthetic_chat import write_synthetic_chat
from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments, set_seed

from lmforge.config.schema import DataConfig, ModelConfig, SourceConfig, TokenizerTrainConfig
from lmforge.data.collate import PackedCollator
from lmforge.data.ragged import PackedDataset, SampleDataset
from lmforge.data.sft import prepare_sft_data
from lmforge.data.tokenizer import train_tokenizer
from lmforge.models.build import build_model
from lmforge.train.hf_trainer import HFTrainerAdapter
from lmforge.train.numerics import CountingCollator


class TokenClock(TrainerCallback):
    """(time, real tokens seen) at every step end."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int]] = []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.points.append((time.perf_counter(), state.num_input_tokens_seen))

    def tokens_per_s(self, warmup: int) -> float:
        (t0, n0), (t1, n1) = self.points[warmup], self.points[-1]
        return (n1 - n0) / (t1 - t0)

    def tokens(self, warmup: int) -> int:
        """Real tokens of the steps after `warmup + 1` (the same window as tokens_per_s)."""
        return self.points[-1][1] - self.points[warmup][1]

    def window_steps(self, warmup: int) -> int:
        return len(self.points) - 1 - warmup


def arguments(out: Path, batch: int, steps: int, *, count_non_padding: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding" if count_non_padding else "no",
        disable_tqdm=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--packed-rows", type=int, default=2, help="packed rows per step (lmforge)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data_file = out / "chat.jsonl"
        write_synthetic_chat(data_file, opts.rows)  # answers: median ~60 words, tail to 900
        tokenizer = train_tokenizer(
            data_file.read_text().splitlines()[:500], TokenizerTrainConfig(vocab_size=2048)
        )
        cfg = DataConfig(
            train=[SourceConfig(path=str(data_file))], max_length=opts.max_length, over_length="truncate"
        )
        sft = prepare_sft_data(
            cfg, tokenizer, seed=0, cache_dir=out / "cache", quarantine_path=out / "bad.jsonl"
        )
        lengths = sft.train.lengths()
        packed = PackedDataset(sft.train, opts.max_length)
        samples_per_row = len(sft.train) / len(packed)
        # Same real-token budget per step: the baseline takes as many samples as the packed rows hold.
        baseline_batch = max(1, round(opts.packed_rows * samples_per_row))
        results: dict[str, list[float]] = {"baseline": [], "lmforge": []}
        pad_waste = []
        for _ in range(opts.repeats):
            for side in ("baseline", "lmforge"):
                set_seed(0)
                model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=opts.max_length)
                clock = TokenClock()
                if side == "baseline":
                    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
                    args = arguments(out / side, baseline_batch, opts.steps, count_non_padding=True)
                    trainer = Trainer(
                        model=model,
                        args=args,
                        train_dataset=SampleDataset(sft.train),
                        data_collator=collator,
                        callbacks=[clock],
                    )
                else:
                    collator = CountingCollator(PackedCollator(pad_token_id=tokenizer.pad_token_id))
                    args = arguments(out / side, opts.packed_rows, opts.steps, count_non_padding=False)
                    trainer = HFTrainerAdapter(
                        model=model,
                        args=args,
                        train_dataset=packed,
                        data_collator=collator,
                        callbacks=[clock],
                    )
                trainer.train()
                results[side].append(clock.tokens_per_s(opts.warmup))
                if side == "lmforge":
                    slots = clock.window_steps(opts.warmup) * opts.packed_rows * opts.max_length
                    pad_waste.append(1 - clock.tokens(opts.warmup) / slots)
    base, ours = statistics.median(results["baseline"]), statistics.median(results["lmforge"])
    print(
        f"samples {len(lengths)}, length p50 {np.percentile(lengths, 50):.0f} p90 {np.percentile(lengths, 90):.0f} "
        f"max {lengths.max()}, max_length {opts.max_length}"
    )
    print(
        f"lmforge: {opts.packed_rows} packed rows/step ({samples_per_row:.1f} samples/row); "
        f"baseline: {baseline_batch} samples/step padded to the longest"
    )
    print(
        f"baseline HF padded : {base:,.0f} non-pad tokens/s  runs={[round(r) for r in results['baseline']]}"
    )
    print(f"lmforge packed     : {ours:,.0f} non-pad tokens/s  runs={[round(r) for r in results['lmforge']]}")
    print(
        f"ratio: {ours / base:.2f}x (goal >= 1.8x); lmforge pad+waste {statistics.median(pad_waste):.2%} "
        f"of token slots (goal <= 2%)"
    )


if __name__ == "__main__":
    main()
