"""Tiny named architectures for offline runs, tests and the quickstart.

Each preset is AutoConfig kwargs; `vocab_size` and the special-token ids come from the
tokenizer at build time, and the position table grows to `data.max_length` when needed.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import UserInputError

_MOE_TINY: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    # About 5M parameters with an 8k vocabulary: 4 layers of width 256, GQA, tied embeddings.
    "llama-tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen2-tiny": {
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    "mistral-tiny": {
        "model_type": "mistral",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
    # Mixture-of-Experts, llama-tiny's shape with its MLP split into 4 experts of half its width:
    # top-2 routing runs as much MLP per token as llama-tiny's (2 x 344 = 688). transformers 5
    # holds each layer's experts fused, in experts.gate_up_proj [4, 688, 256] and
    # experts.down_proj [4, 256, 344]; the router is mlp.gate.
    "qwen2-moe-tiny": {
        "model_type": "qwen2_moe",
        **_MOE_TINY,
        "num_experts": 4,
        "moe_intermediate_size": 344,
        "shared_expert_intermediate_size": 344,  # Qwen2-MoE adds one always-on shared expert
        "intermediate_size": 688,  # dense layers only (none here: every layer is sparse)
    },
    "qwen3-moe-tiny": {
        "model_type": "qwen3_moe",
        **_MOE_TINY,
        "num_experts": 4,
        "moe_intermediate_size": 344,
    },
    "mixtral-tiny": {
        "model_type": "mixtral",
        **_MOE_TINY,
        "num_local_experts": 4,
        "intermediate_size": 344,  # Mixtral's expert width
    },
    "gpt2-tiny": {
        "model_type": "gpt2",
        "n_embd": 256,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 1024,
        "tie_word_embeddings": True,
    },
}

# Config keys that hold the length of a learned or rope position table, per family.
POSITION_KEYS = ("max_position_embeddings", "n_positions")


def preset_kwargs(name: str) -> dict[str, Any]:
    """A copy of a preset's AutoConfig kwargs; unknown names list the valid ones."""
    if name not in PRESETS:
        raise UserInputError(
            f"model.preset: unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}"
        )
    return dict(PRESETS[name])
