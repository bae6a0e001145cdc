"""final/: the trained model in HF format, written once, atomically, with the record that the run
finished (`lmforge_finished.json`, so final/ exists exactly when the run is done), sealed like a
checkpoint (a sha256 manifest of every file and a completion marker) so that `lmforge push` and
`lmforge ckpt verify` can tell the model training wrote from one edited afterwards."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase, Trainer

from lmforge.ckpt.atomic import remove_within, seal_directory
from lmforge.ckpt.resumable import nonfinite_tensors
from lmforge.data.chat import stop_token_ids
from lmforge.data.chat_templates import builtin_template_name
from lmforge.distributed.ranks import wait_for_everyone
from lmforge.errors import WorkFailed
from lmforge.run_layout import FINISHED_NAME, RunPaths


def untie_if_diverged(model: Any) -> None:
    """A modules_to_save embedding trains a copy for the input side only; the tied output head
    kept the original. Saved as tied, a reload would tie the head to the trained copy and the
    merged model would no longer be the model that was trained."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    config = model.config.get_text_config()
    if head is None or not config.tie_word_embeddings or head.weight is embedding.weight:
        return
    if not torch.equal(head.weight, embedding.weight):
        config.tie_word_embeddings = False
        model.config.tie_word_embeddings = False


def stop_at_template_turn_end(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's generation_config (generation_config.json in final/) stop on the stop tokens
    of the built-in chat template the run trained with, as well as the ids it already lists.

    The base model's config knows its own EOS only: a base model tuned on Llama 3's or Gemma's
    turns would run past <|eot_id|> / <end_of_turn> in transformers, vLLM or TGI, which read it.
    Nothing changes under the tokenizer's own template (its model's config already knows it).
    """
    config = getattr(model, "generation_config", None)
    if config is None or builtin_template_name(tokenizer.chat_template) is None:
        return
    listed = config.eos_token_id
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    stops = sorted(set(listed) | stop_token_ids(tokenizer))
    config.eos_token_id = stops[0] if len(stops) == 1 else stops


def refuse_nonfinite_weights(staging: Path, paths: RunPaths) -> None:
    """final/ is never sealed with NaN or inf weights: a run that diverged fails (exit code 1)."""
    for path in sorted(staging.rglob("*.safetensors")):
        bad, total = nonfinite_tensors(path)
        if bad:
            raise WorkFailed(
                f"final/ was not written: the trained weights hold NaN or inf ({len(bad)} of {total} tensors "
                f"in {path.relative_to(staging)}, first {bad[0]}); training diverged (`lmforge doctor "
                f"{paths.root}` shows where). Resume from a checkpoint before it with train.resume=PATH and "
                "a lower train.lr, or set monitor.guard.nonfinite=rollback"
            )


def refuse_nonfinite_final_eval(records: list[dict[str, Any]], paths: RunPaths) -> None:
    """final/ is never written when the last evaluation was NaN or inf: finite weights can still
    give non-finite outputs (an overflow in a 16-bit forward), and such a model is no result."""
    last = next((record for record in reversed(records) if "eval_loss" in record), None)
    if last is None:
        return
    try:
        loss = float(last["eval_loss"])
    except (TypeError, ValueError):
        return
    if not math.isfinite(loss):
        raise WorkFailed(
            f"final/ was not written: the evaluation at step {last.get('step')} gave eval_loss {loss} (the "
            f"trained model's outputs are not finite; `lmforge doctor {paths.root}` shows where the run went "
            "wrong). Resume from an earlier checkpoint with train.resume=PATH, or train in fp32 / bf16 "
            "instead of fp16"
        )


def save_final(
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerBase,
    paths: RunPaths,
    *,
    merge_lora: bool,
    finished: dict[str, Any],
    extra_files: Sequence[Path] = (),
) -> None:
    """final/: the HF-format model and tokenizer, written aside and renamed into place, with the
    record that the run finished (so final/ exists exactly when the run is done). `extra_files`
    are copied beside them (a vision-language model's processor settings).

    An adapter run writes the PEFT adapter to final/adapter/ (PeftModel.from_pretrained loads
    it onto its base) and, with export.merge_lora, the merged full model into final/ itself.
    Every file, final/adapter/ included, is in final/'s hash manifest (`ckpt/atomic.py`).
    """
    staging = paths.final_partial
    if trainer.is_world_process_zero():
        remove_within(staging, paths.root)
    wait_for_everyone()  # no rank writes its part before the old leftovers are gone
    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = isinstance(model, PeftModel)
    stop_at_template_turn_end(model, tokenizer)  # a PeftModel's is its base model's, kept by the merge
    trainer.save_model(str(staging / "adapter" if adapter else staging))
    if not trainer.is_world_process_zero():
        return
    if adapter and merge_lora:
        merged = model.merge_and_unload()
        dtype = getattr(trainer, "weights_dtype", None)
        if dtype is not None:
            # DeepSpeed cast the module to its 16-bit training dtype; final/ is in model.dtype.
            merged = merged.to(dtype)
        untie_if_diverged(merged)
        merged.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    for extra in extra_files:  # e.g. a vision-language model's processor settings
        shutil.copy2(extra, staging / extra.name)
    refuse_nonfinite_weights(staging, paths)
    for args_pickle in staging.rglob("training_args.bin"):
        args_pickle.unlink()  # a pickle nobody needs in an export
    (staging / FINISHED_NAME).write_text(json.dumps(finished, indent=2), encoding="utf-8")
    seal_directory(staging, step=int(finished["step"]))  # last: nothing is written into final/ after it
    # Only an explicitly extended run replaces a final/: the old one goes aside, then one rename.
    old = paths.root / "final.old"
    if paths.final.exists():
        remove_within(old, paths.root)
        os.rename(paths.final, old)
    os.rename(staging, paths.final)
    remove_within(old, paths.root)
