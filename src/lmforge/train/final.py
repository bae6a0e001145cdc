"""final/: the trained model in HF format, written once, atomically, with the record that the run
finished (`lmforge_finished.json`, so final/ exists exactly when the run is done)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase, Trainer

from lmforge.ckpt.atomic import remove_within
from lmforge.data.chat import stop_token_ids
from lmforge.data.chat_templates import builtin_template_name
from lmforge.distributed.ranks import wait_for_everyone
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


def save_final(
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerBase,
    paths: RunPaths,
    *,
    merge_lora: bool,
    finished: dict[str, Any],
) -> None:
    """final/: the HF-format model and tokenizer, written aside and renamed into place, with the
    record that the run finished (so final/ exists exactly when the run is done).

    An adapter run writes the PEFT adapter to final/adapter/ (PeftModel.from_pretrained loads
    it onto its base) and, with export.merge_lora, the merged full model into final/ itself.
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
    for args_pickle in staging.rglob("training_args.bin"):
        args_pickle.unlink()  # a pickle nobody needs in an export
    (staging / FINISHED_NAME).write_text(json.dumps(finished, indent=2), encoding="utf-8")
    # Only an explicitly extended run replaces a final/: the old one goes aside, then one rename.
    old = paths.root / "final.old"
    if paths.final.exists():
        remove_within(old, paths.root)
        os.rename(paths.final, old)
    os.rename(staging, paths.final)
    remove_within(old, paths.root)
