"""`lmforge ckpt convert --to compressed-tensors`: FP8 and integer weight checkpoints for vLLM.

The format is compressed-tensors, the one llm-compressor writes and vLLM (and transformers) read;
the compressed-tensors library does the work: its preset schemes, its scale arithmetic, its
compressors and its config record. The schemes are the data-free ones:

  fp8    FP8_DYNAMIC: FP8 (e4m3) weights with one scale per output channel, activations quantized
         to FP8 per token at run time (vLLM's W8A8 FP8 on Hopper/Ada GPUs, Marlin weight-only before)
  w8a16  int8 weights, one scale per group of 128 inputs, 16-bit activations
  w4a16  int4 weights, one scale per group of 128 inputs, 16-bit activations (the GPTQ/Marlin layout)

A weight's scales come from its own min and max per channel or group, as llm-compressor's data-free
path computes them. Calibrated GPTQ / AWQ need activations and llm-compressor's modifiers, and
llm-compressor pins transformers <= 5.17 (lmforge runs 5.23), so they are not offered; the gates
tell whether the data-free result is good enough. lm_head stays in the model's dtype, as vLLM's
presets leave it. Verification runs the file in transformers with compressed-tensors, which
decompresses the weights and, for fp8, quantizes activations per token as vLLM does.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.to_safetensors import SIDE_FILES, check_output
from lmforge.upstream import route_deepspeed_logs
from lmforge.verbosity import stderr_to_log

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# --dtype -> compressed-tensors' preset scheme name.
SCHEMES = {"fp8": "FP8_DYNAMIC", "w8a16": "W8A16", "w4a16": "W4A16"}
DEFAULT_SCHEME = "fp8"
GROUPED = ("w8a16", "w4a16")  # one scale per 128 inputs: every quantized layer's input size a multiple of 128
log = logging.getLogger(__name__)
INSTALL = "pip install 'lmforge[quantize]' (compressed-tensors)"
_KEEP = ["lm_head"]  # the output projection stays unquantized, as in vLLM's own presets


def require_compressed_tensors(dtype: str) -> None:
    """UserInputError, before any work, when compressed-tensors is missing."""
    if importlib.util.find_spec("compressed_tensors") is None:
        raise UserInputError(
            f"--to compressed-tensors --dtype {dtype}: the compressed-tensors library writes this format "
            f"and it is not installed. Fix: {INSTALL}"
        )


def parse_scheme(dtype: str | None) -> str:
    name = dtype or DEFAULT_SCHEME
    if name not in SCHEMES:
        raise UserInputError(
            f"--dtype {name!r}: compressed-tensors exports are {', '.join(SCHEMES)} (fp8: FP8 weights and "
            "activations; w8a16 / w4a16: int8 / int4 weights)"
        )
    return name


def convert_to_compressed(source: Path, out: Path, *, dtype: str | None) -> Conversion:
    """Quantize the HF model in `source` into a compressed-tensors checkpoint in `out`."""
    name = parse_scheme(dtype)
    require_compressed_tensors(name)
    check_output(source, out)
    _refuse_unsupported(source, name)
    route_deepspeed_logs()  # compressed-tensors imports accelerate, which imports DeepSpeed
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = _load_full_precision(source)
    scheme = preset_name_to_scheme(SCHEMES[name], ["Linear"])
    with stderr_to_log("compressed-tensors"):  # its tqdm bar per pass over the layers
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=_KEEP))
        quantized = 0
        for module_name, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _set_weight_scales(module_name, module)
                module.quantization_status = QuantizationStatus.FROZEN
                quantized += 1
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    model.save_pretrained(out)  # config.json with the model's settings, then its quantization record
    compressor.update_config(str(out))
    _copy_tokenizer_files(source, out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    return Conversion(
        "compressed-tensors",
        out,
        files,
        {
            "scheme": SCHEMES[name],
            "quantized_layers": quantized,
            "kept": _KEEP,
            "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        },
    )


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    """The tokenizer and chat template; config.json is the one save_pretrained wrote, with the quantization."""
    for name in SIDE_FILES:
        if not (out / name).exists() and (source / name).is_file():
            shutil.copy2(source / name, out / name)


def _set_weight_scales(module_name: str, module: Any) -> None:  # a Linear compressed-tensors extended
    """The module's weight scale (and zero point) from the min and max of each channel or group,
    through compressed-tensors' own `calculate_qparams`."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    if args.strategy == "group":
        if weight.shape[1] % args.group_size:  # a layer the config's sizes did not show (_refuse_unsupported)
            raise UserInputError(
                f"{module_name}: {weight.shape[1]} inputs, not a multiple of the group size {args.group_size}. "
                "Fix: --dtype fp8 (one scale per channel), or GGUF"
            )
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    else:  # channel: one scale per output row
        low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def _load_full_precision(source: Path) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    # Scales are computed from float32 weights: a bf16 model's channel ranges are exact in f32.
    return AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, trust_remote_code=False, use_safetensors=True
    )


def _refuse_unsupported(source: Path, name: str) -> None:
    """Before loading anything: a model this scheme cannot be applied to, with the reason."""
    config = json.loads((source / "config.json").read_text())
    if "quantization_config" in config:
        raise UserInputError(
            f"{source}: already quantized ({config['quantization_config'].get('quant_method', '?')}); "
            "quantize the full-precision model it came from"
        )
    check_scheme_fits(config, name, str(source))


def check_scheme_fits(config: dict[str, Any], name: str, what: str) -> None:
    """UserInputError when scheme `name` cannot be applied to the model of `config` (config.json's
    dict): MoE experts it would leave unquantized, input sizes that are not whole groups."""
    text = config.get("text_config") or config
    if any(text.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserInputError(
            f"{what}: a Mixture-of-Experts model; its experts are fused 3-D weights in transformers 5, not "
            "Linear layers, so a compressed-tensors export would leave them unquantized. Fix: export it as "
            "GGUF (q8_0 or a k-quant), or safetensors in bf16"
        )
    if name in GROUPED:
        heads, head_dim = text.get("num_attention_heads"), text.get("head_dim")
        inputs = {
            "hidden_size": text.get("hidden_size"),
            "intermediate_size": text.get("intermediate_size"),
            "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None,
        }
        odd = {key: size for key, size in inputs.items() if isinstance(size, int) and size % 128}
        if odd:
            sizes = ", ".join(f"{key} {size}" for key, size in odd.items())
            raise UserInputError(
                f"{what}: {name} quantizes weights in groups of 128 inputs, and the model's {sizes} "
                f"{'is' if len(odd) == 1 else 'are'} not a multiple of 128 (vLLM's kernels need whole groups). Fix: fp8 (one scale per channel), or GGUF "
                "(q8_0, q4_k_m)"
            )
