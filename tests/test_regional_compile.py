"""`train.compile: layers` finds the decoder layers (by the model's `_no_split_modules`, inside a
LoRA adapter too, else the largest list of identical blocks) and compiles them in place: the
parameter names stay an eager model's, and a model without layers is refused by its class.
Nothing here runs a forward: inductor's cost is the end-to-end test's (test_training_recipe.py)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.errors import UserInputError
from lmforge.train.regional_compile import compile_layers, decoder_layers


def _tiny_llama(layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 4) for _ in range(4))  # more of them than layers


class _NoSplitList(nn.Module):
    """A model with no `_no_split_modules`: its layers are its ModuleList of identical blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 16)


class _NoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def test_compile_finds_the_layers_by_their_no_split_class() -> None:
    model = _tiny_llama()
    assert decoder_layers(model) == list(model.model.layers)


def test_compile_finds_the_layers_inside_a_lora_adapter() -> None:
    base = _tiny_llama()
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = decoder_layers(adapted)
    assert layers == list(base.model.layers)  # the layers PEFT injected its LoRA linears into
    assert hasattr(layers[0].self_attn.q_proj, "lora_A")


def test_compile_takes_the_largest_list_of_identical_blocks_without_no_split_modules() -> None:
    model = _NoSplitList()
    assert decoder_layers(model) == list(model.layers)  # not a block's longer list of experts


def test_compile_layers_refuses_a_model_without_layers_by_its_class() -> None:
    with pytest.raises(UserInputError, match=r"train\.compile: layers: found no decoder layers in _NoLayers"):
        decoder_layers(_NoLayers())


def test_compiled_layers_keep_their_parameter_names() -> None:
    model = _tiny_llama()
    names = list(model.state_dict())
    said = compile_layers(model, "default")
    assert said == (
        "compile: 3 decoder layers (LlamaDecoderLayer) compiled in place, mode default; the loss runs eager"
    )
    assert list(model.state_dict()) == names  # no `_orig_mod.`: checkpoints and exports as eager's
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    eager = (model.model.embed_tokens, model.model.norm, model.lm_head)
    assert all(module._compiled_call_impl is None for module in eager)
