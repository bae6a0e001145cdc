"""Write a real DeepSpeed ZeRO checkpoint: HF Trainer + a DeepSpeed config dict, a few steps.

Run under `torchrun --nproc_per_node 2 tests/dist_scripts/write_zero_checkpoint.py BASE OUT STAGE [STEPS]`
where BASE is an HF model directory with its tokenizer. The Trainer saves OUT/checkpoint-STEPS/
(config, tokenizer, `latest`, global_stepSTEPS/ with the rank files); afterwards every rank
gathers the trained parameters and rank 0 writes OUT/reference.safetensors with the logits of a
fixed batch, so a test can compare a consolidated model with the model as training left it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, vocab_size: int, rows: int = 16, length: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(3, vocab_size, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def reference_inputs(vocab_size: int) -> torch.Tensor:
    return (torch.arange(2 * 16).reshape(2, 16) * 7) % vocab_size


def main(base: Path, out: Path, stage: int, steps: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    # NOTES.md: with train_batch_size "auto" DeepSpeed computed the wrong world size on CPU;
    # micro-batch and accumulation set explicitly work.
    deepspeed_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=steps,
        logging_steps=1,
        report_to=[],
        deepspeed=deepspeed_config,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(model.config.vocab_size),
        processing_class=tokenizer,
    )
    trainer.train()
    engine = trainer.model_wrapped
    module = engine.module
    module.eval()
    parameters = list(module.parameters())
    import deepspeed

    # Under ZeRO-3 each rank holds a slice; gathering is a collective every rank joins.
    with deepspeed.zero.GatheredParameters(parameters, enabled=stage == 3), torch.no_grad():
        logits = module(reference_inputs(module.config.vocab_size)).logits
    if torch.distributed.get_rank() == 0:
        save_file({"logits": logits.contiguous()}, str(out / "reference.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 3)
