"""`lmforge ckpt convert --to onnx`: an HF causal LM as an ONNX decoder graph, checked in onnxruntime.

The graph takes `input_ids` and `attention_mask` (int64, dynamic batch and sequence) and
returns `logits` [batch, sequence, vocab]; it has no KV cache, so generation recomputes the
whole sequence each step (`OnnxCausalLM.greedy`). It is exported with torch.onnx's dynamo
exporter (torch.export + onnxscript), which traces transformers 5's mask creation and sdpa
attention with symbolic batch and sequence sizes; the legacy TorchScript exporter is not used.

After export the graph runs once in onnxruntime on a left-padded batch and its logits are
compared with the torch model's; a difference above tolerance fails the conversion.
"""

from __future__ import annotations

import logging
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmforge.errors import CheckpointError, UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.to_safetensors import copy_side_files
from lmforge.export.weight_sources import model_shards

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
# Protobuf cannot hold more than 2 GiB, so larger models keep their weights in model.onnx.data.
EXTERNAL_DATA_THRESHOLD = 2 * 10**9
# The graph's weight dtype per --dtype; int8 is the f32 graph with its MatMul weights quantized by
# onnxruntime's dynamic quantization (int8 weights with one scale per output channel, activations
# quantized on the fly), the int8 graph onnxruntime's CPU kernels run.
ONNX_DTYPES = {"f32": torch.float32, "f16": torch.float16, "int8": torch.float32}
# Largest |onnxruntime - torch| logit difference allowed, relative to the largest |logit| of the
# torch model (the convention `ckpt verify` uses). f32: both sides compute the same graph in
# f32 and differ only in reduction order (measured ~3e-7 on tiny models), so 1e-4 leaves room
# for depth while a wrong mask or position would be O(1). f16: one rounding is ~5e-4 relative
# and it compounds over the layers; 5e-2 is about a hundred roundings and half of verify's
# f16 limit, so an export that passes here has room left at verify.
# int8: a sanity bound (a wrong graph is off by the whole scale); what the quantization costs is
# judged by verify's gates, on perplexity, top-1 agreement and task accuracy.
TOLERANCE = {"f32": 1e-4, "f16": 5e-2, "int8": 0.5}
_EXPORT_SHAPE = (2, 8)  # batch and sequence of the tracing example (both stay symbolic)
_CHECK_SHAPE = (2, 16)
_CHECK_PADDING = 5  # left-padded positions in the second row of the parity batch


def convert_to_onnx(
    source: Path, out: Path, *, dtype: str, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD
) -> Conversion:
    """Export the HF causal LM in `source` to `out/model.onnx` (f32 or f16) and check it in onnxruntime.

    Weights go to `model.onnx.data` when the model holds more than `external_data_threshold`
    bytes. The config, generation config and tokenizer files are copied next to the graph."""
    import onnx

    if dtype not in ONNX_DTYPES:
        raise UserInputError(f"--dtype {dtype!r}: an ONNX export is f32, f16 or int8; choose one of those")
    model = load_source(source)
    ids, mask = _parity_batch(model)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits.float().numpy()
    model.to(ONNX_DTYPES[dtype])  # type: ignore[arg-type]  # transformers types .to() for devices only
    weight_bytes = _weight_bytes(model)
    external = weight_bytes > external_data_threshold
    path = out / ONNX_NAME
    try:
        program = _export(model)
    except torch.onnx.OnnxExporterError as err:
        # An architecture the exporter cannot translate (MoE routing's grouped matmul, say) is
        # an unsupported combination, not a crash: one paragraph, with the formats that work.
        raise UserInputError(
            f"{source}: torch's ONNX exporter cannot translate this {model.config.model_type} model "
            f"({_root_cause(err)}). ONNX export is tested for llama, qwen2 and mistral decoders; keep this "
            "model as safetensors (`--to safetensors`) or serve it from its HF directory"
        ) from None
    float_path = path.with_name("model.float.onnx") if dtype == "int8" else path
    program.save(str(float_path), external_data=external)
    del model
    if dtype == "int8":
        _quantize_int8(float_path, path, external=external)
    try:  # the path form reads external data and works above 2 GiB
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as err:
        raise CheckpointError(f"{path}: the exported graph fails the ONNX checker: {err}") from None
    files = [path, *([path.with_name(ONNX_NAME + ".data")] if external else [])]
    files += copy_side_files(source, out)

    diff, scale = check_parity(out, ids.numpy(), mask.numpy(), reference, dtype)
    opset = next(
        o.version for o in onnx.load(str(path), load_external_data=False).opset_import if not o.domain
    )
    return Conversion(
        "onnx",
        out,
        files,
        {
            "dtype": dtype,
            "opset": opset,
            "exporter": f"torch.onnx dynamo (torch {torch.__version__})",
            "inputs": ["input_ids", "attention_mask"],
            "outputs": ["logits"],
            "kv_cache": False,
            "external_data": external,
            "weight_bytes": weight_bytes,
            "max_abs_diff": diff,
            "max_rel_diff": diff / scale,
            "tolerance_rel": TOLERANCE[dtype],
            "checked_on": f"batch {_CHECK_SHAPE[0]} x {_CHECK_SHAPE[1]} tokens, {_CHECK_PADDING} left-padded",
        },
    )


def _quantize_int8(float_path: Path, path: Path, *, external: bool) -> None:
    """onnxruntime's dynamic int8 quantization of the graph's MatMul weights, per output channel;
    the float graph is removed after."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        float_path,
        path,
        weight_type=QuantType.QInt8,
        per_channel=True,
        op_types_to_quantize=["MatMul"],
        use_external_data_format=external,
    )
    for leftover in (float_path, float_path.with_name(float_path.name + ".data")):
        leftover.unlink(missing_ok=True)


def check_parity(
    out: Path, ids: np.ndarray, mask: np.ndarray, reference: np.ndarray, dtype: str
) -> tuple[float, float]:
    """The largest |onnxruntime - reference| logit difference over unpadded positions, and the
    scale it is judged against; a CheckpointError when it is above TOLERANCE[dtype] of the scale."""
    ours = OnnxCausalLM(out).run(ids, mask)
    valid = mask.astype(bool)  # padded positions have no defined logits
    diff = float(np.abs(ours[valid] - reference[valid]).max())
    scale = max(1.0, float(np.abs(reference[valid]).max()))
    if not diff <= TOLERANCE[dtype] * scale:  # NaN fails too
        raise CheckpointError(
            f"{out / ONNX_NAME}: onnxruntime logits differ from the torch model's by {diff:.3g} (largest "
            f"|logit| {scale:.3g}, allowed {TOLERANCE[dtype]:g} of it at {dtype}); the export is wrong, "
            "not saved"
        )
    return diff, scale


def load_source(source: Path) -> PreTrainedModel:
    """The f32 torch model in `source` with sdpa attention and no cache, or a UserInputError saying why not."""
    from transformers import AutoModelForCausalLM

    if not (source / "config.json").is_file():
        hint = (
            " (an adapter run's final/: merge it first with `lmforge ckpt merge-lora`)"
            if (source / "adapter").is_dir()
            else ""
        )
        raise UserInputError(f"{source}: no config.json; point it at an HF model directory{hint}")
    if not model_shards(source):
        raise UserInputError(
            f"{source}: no model.safetensors or model.safetensors.index.json; convert legacy weights "
            "first with `lmforge ckpt convert --to safetensors` (or merge an adapter with merge-lora)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        str(source),
        dtype=torch.float32,
        attn_implementation="sdpa",
        use_safetensors=True,
        **_experts_kwargs(source),
    )
    model.config.use_cache = False
    return model.eval()


def _experts_kwargs(source: Path) -> dict[str, Any]:
    """A Mixture-of-Experts model is traced with transformers' `batched_mm` experts (each token's
    chosen experts as one batched matmul, fixed shapes): the default `grouped_mm` sorts tokens by
    expert into data-dependent groups, an op the ONNX exporter has no translation for."""
    from transformers import AutoConfig

    from lmforge.models.moe import is_moe

    return {"experts_implementation": "batched_mm"} if is_moe(AutoConfig.from_pretrained(source)) else {}


class _LogitsOnly(torch.nn.Module):
    """The graph's signature: (input_ids, attention_mask) -> logits, no cache in or out."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost cause (the operator that has no ONNX translation), without
    the exporter's terminal colours."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _export(model: PreTrainedModel) -> Any:
    log.info("exporting to ONNX with torch.export + onnxscript (minutes for a large model)")
    ids = torch.ones(_EXPORT_SHAPE, dtype=torch.long)
    dims = {0: "batch", 1: "sequence"}
    with _quiet_exporter(), torch.no_grad():
        return torch.onnx.export(
            _LogitsOnly(model).eval(),
            (ids, torch.ones_like(ids)),
            dynamo=True,
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": dims, "attention_mask": dims},
            verbose=False,
        )


@contextmanager
def _quiet_exporter() -> Any:
    """Hide the exporter's noise: per-op registration warnings (torchvision ops it cannot find),
    a pytree deprecation and the note that batch and sequence share a constraint."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*The axis name.*", category=UserWarning)
            yield
    finally:
        registration.setLevel(level)


def _parity_batch(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of seeded random tokens; the second left-padded, so the check covers the mask too."""
    length = min(_CHECK_SHAPE[1], int(getattr(model.config, "max_position_embeddings", 0) or 10**9))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (_CHECK_SHAPE[0], length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :_CHECK_PADDING] = 0
    return ids, mask


def _weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


class OnnxCausalLM:
    """An exported directory run in onnxruntime (CPUExecutionProvider), for `ckpt verify`."""

    def __init__(self, directory: Path) -> None:
        import onnxruntime as ort

        path = directory / ONNX_NAME if directory.is_dir() else directory
        if not path.is_file():
            raise UserInputError(
                f"{directory}: no {ONNX_NAME}; export one with `lmforge ckpt convert --to onnx`"
            )
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """float32 logits [batch, sequence, vocab] for int64 ids and mask [batch, sequence]."""
        feeds = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
        }
        (logits,) = self.session.run(["logits"], feeds)
        return np.asarray(logits, dtype=np.float32)

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Next-token logits at every position, float32 [len(token_ids), vocab]."""
        ids = np.asarray([token_ids], dtype=np.int64)
        return self.run(ids, np.ones_like(ids))[0]

    def greedy(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] | None = None
    ) -> list[int]:
        """The new token ids of the greedy continuation (prompt excluded), ending at the first id in
        stop_ids (included) when one is produced. The graph has no KV cache: each step recomputes
        the whole sequence."""
        ids = list(prompt_ids)
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = int(self.logits(ids)[-1].argmax())
            new.append(token)
            ids.append(token)
            if stop_ids and token in stop_ids:
                break
        return new
