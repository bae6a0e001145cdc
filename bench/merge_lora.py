"""LoRA merge: `lmforge ckpt merge-lora` (shard by shard) vs PEFT `merge_and_unload()` + `save_pretrained`.

Same base (a randomly initialised Llama-style model saved as safetensors shards), same
adapter (r=16 on every linear layer, non-zero B). Each side runs in its own spawned child
process; the figures are wall time from start to merged files on disk, and the child's peak
RSS (ru_maxrss). Runs alternate.

    .venv/bin/python bench/merge_lora.py [--hidden 1024 --layers 12 --shard-size 200MB --repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sft_prepare import _peak_rss_mib, measure
from side_by_side import medians_by_side, random_llama


def run_peft(base: str, adapter: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(out, max_shard_size="200MB")
    queue.put({"seconds": time.perf_counter() - started, "peak_rss_mib": _peak_rss_mib()})


def run_lmforge(base: str, adapter: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    from lmforge.export.merge import merge_lora

    started = time.perf_counter()
    merge_lora(Path(base), Path(adapter), Path(out))
    queue.put({"seconds": time.perf_counter() - started, "peak_rss_mib": _peak_rss_mib()})


def make_base_and_adapter(root: str, hidden: int, layers: int, shard_size: str, queue) -> None:  # type: ignore[no-untyped-def]
    """Runs in its own child: ru_maxrss survives fork + exec, so a parent that held the model
    would lend its peak to every measured child."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = random_llama(hidden, layers)
    model.save_pretrained(Path(root) / "base", max_shard_size=shard_size)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    peft_model.save_pretrained(Path(root) / "adapter")
    queue.put({"parameters": sum(p.numel() for p in model.parameters())})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = measure(make_base_and_adapter, str(root), opts.hidden, opts.layers, opts.shard_size)
        print(f"base: {made['parameters'] / 1e6:.0f}M parameters, fp32, shards of {opts.shard_size}")
        base, adapter = root / "base", root / "adapter"
        runs: dict[str, list[dict]] = {"peft": [], "lmforge": []}
        for repeat in range(opts.repeats):
            runs["peft"].append(measure(run_peft, str(base), str(adapter), str(root / f"peft{repeat}")))
            runs["lmforge"].append(measure(run_lmforge, str(base), str(adapter), str(root / f"lm{repeat}")))
        medians = medians_by_side(runs, width=8)
        print(
            f"lmforge / PEFT: time {medians['lmforge'][0] / medians['peft'][0]:.2f}x (goal <= 1.0x), "
            f"peak RSS {medians['lmforge'][1] / medians['peft'][1]:.2f}x (goal <= 0.5x)"
        )


if __name__ == "__main__":
    main()
