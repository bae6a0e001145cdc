"""The registry's instance attributes, checked on real objects: a tiny HF Trainer after one step, a
tiny model, an Accelerator, an Optuna trial. upstream.coupling_problem can only read the syntax
tree of the function that sets such an attribute (`set_in`); here the object is built and asked.

Some stay on the syntax tree (listed in SYNTAX_ONLY): building them takes a TRL GRPO / RLOO trainer
with a reward and a generation config (every RL run of tests/test_rl_stage.py reads them), a PEFT
LoRA over a fused-expert MoE model, or a llama.cpp model (an optional dependency)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from lmforge import upstream

SYNTAX_ONLY = {
    "trl.trainer.grpo_trainer:GRPOTrainer._logs",
    "trl.trainer.grpo_trainer:GRPOTrainer._metrics",  # rl check's tool episodes (tests/test_rl_tools.py)
    *(
        f"trl.trainer.{module}:{cls}.{name}"
        for module, cls in (("grpo_trainer", "GRPOTrainer"), ("rloo_trainer", "RLOOTrainer"))
        for name in ("reward_funcs", "reward_weights")
    ),
    "peft.tuners.lora.layer:ParamWrapper.parameter_name",
    # GradScaler.step sets found_inf on a fused optimizer for the length of that step only (it deletes it
    # after), so no object holds it to build; tests/test_guardrails.py's device-judged run shows the fused
    # AdamW honours it (the steps it flags leave the weights bit for bit as the host's verdict does).
    *(
        f"torch.optim.{module}:{cls}.found_inf"
        for module, cls in (("adam", "Adam"), ("adamw", "AdamW"), ("sgd", "SGD"), ("adagrad", "Adagrad"))
    ),
    # A Llama needs a GGUF file and llama-cpp-python, which CI does not install (it compiles llama.cpp);
    # tests/test_vision_export.py's integration test runs the VLM pair through both attributes.
    "llama_cpp.llama:Llama._ctx",
    "llama_cpp.llama:Llama.n_tokens",
}


def _tiny_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@cache
def _trained_trainer() -> Trainer:
    """An HF Trainer after one optimizer step (the training loop sets its private attributes)."""
    rows = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    args = TrainingArguments(
        output_dir="/tmp/lmforge-upstream-instances", max_steps=1, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=True, gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer = Trainer(model=_tiny_model(), args=args, train_dataset=rows)
    trainer.train()
    return trainer


def _model_with_replaced_loss() -> Any:
    model = _tiny_model()
    model.loss_function = lambda *args, **kwargs: None  # where does the setter keep it?
    return model.__dict__  # `_loss_function` must be an instance attribute lmforge can delete


def _accelerator_state() -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)
    return AcceleratorState()


def _hooked_module() -> Any:
    from accelerate.hooks import ModelHook, add_hook_to_module

    return add_hook_to_module(torch.nn.Linear(2, 2), ModelHook())


def _trial() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study().ask()


BUILDERS: dict[str, Callable[[], Any]] = {
    "transformers.trainer:Trainer._tr_loss": _trained_trainer,
    "transformers.trainer:Trainer.current_gradient_accumulation_steps": _trained_trainer,
    "transformers.trainer:Trainer.is_fsdp_enabled": _trained_trainer,
    "transformers.trainer:Trainer.gather_function": _trained_trainer,
    "transformers.trainer:Trainer.optimizer": _trained_trainer,
    "transformers.trainer:Trainer.control": _trained_trainer,
    "accelerate.state:AcceleratorState.device_mesh": _accelerator_state,
    "transformers.modeling_utils:PreTrainedModel.all_tied_weights_keys": _tiny_model,
    "transformers.models.llama.modeling_llama:LlamaForCausalLM.lm_head": _tiny_model,
    "transformers.models.llama.modeling_llama:LlamaModel.norm": lambda: _tiny_model().model,
    "transformers.modeling_utils:PreTrainedModel._loss_function": _model_with_replaced_loss,
    "torch.nn:Module._hf_hook": _hooked_module,
    "optuna.trial._trial:Trial._trial_id": _trial,
    "transformers.tokenization_utils_base:PreTrainedTokenizerBase.chat_template": upstream.bare_fast_tokenizer,
    "transformers.tokenization_utils_base:PreTrainedTokenizerBase.response_template": upstream.bare_fast_tokenizer,
}
SET_IN = [e for e in upstream.REGISTRY if e.set_in is not None and e.instance is None]


def test_every_instance_attribute_has_a_builder_or_says_why_not() -> None:
    targets = {e.target for e in SET_IN}
    assert targets == set(BUILDERS) | SYNTAX_ONLY, (
        f"add a builder for {targets - set(BUILDERS) - SYNTAX_ONLY} (or list it in SYNTAX_ONLY with why); "
        f"stale: {(set(BUILDERS) | SYNTAX_ONLY) - targets}"
    )


@pytest.mark.parametrize("entry", [e for e in SET_IN if e.target in BUILDERS], ids=lambda e: e.target)
def test_the_instance_attribute_is_there_on_a_real_object(entry: upstream.Coupling) -> None:
    name = entry.target.rsplit(".", 1)[-1]
    built = BUILDERS[entry.target]()
    present = name in built if isinstance(built, dict) else hasattr(built, name)
    assert present, (
        f"{entry.target}: a real {type(built).__name__} has no {name} ({entry.where}: {entry.why})"
    )
