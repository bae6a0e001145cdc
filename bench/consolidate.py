"""ZeRO-3 consolidation: `lmforge ckpt consolidate` vs DeepSpeed's zero_to_fp32, on the same checkpoint.

The checkpoint is real: a randomly initialised Llama-style model (untied head, about 220M
parameters with the defaults) trained for one step by DeepSpeed ZeRO-3 on 2 gloo ranks
(torch AdamW, batch 1 x 16 tokens: the cheapest step that writes every rank file), saved with
`engine.save_checkpoint`. DeepSpeed side: `convert_zero_checkpoint_to_fp32_state_dict(ckpt, out,
safe_serialization=True)` (what the zero_to_fp32.py it writes next to every checkpoint runs).
lmforge side: `consolidate(ckpt, out)`. Both write fp32 safetensors in 5 GB shards (one file
here). Each side runs in its own spawned child; figures are wall time and the child's peak RSS
(ru_maxrss, which counts the pages of memory-mapped files it touched). Runs alternate, the page
cache is warm for both (the checkpoint was just written and is re-read before each run). The
outputs are compared tensor by tensor.

    .venv/bin/python bench/consolidate.py [--hidden 1024 --layers 12 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sft_prepare import _peak_rss_mib, measure
from side_by_side import medians_by_side, random_llama


def write_checkpoint(out: str, hidden: int, layers: int) -> None:
    """Runs on each torchrun rank: one ZeRO-3 step, then save_checkpoint (no gathered weights)."""
    import deepspeed
    import torch

    model = random_llama(hidden, layers)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    batch = torch.randint(0, model.config.vocab_size, (1, 16))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out)
    if torch.distributed.get_rank() == 0:
        model.config.save_pretrained(out)  # where lmforge looks for config.json: next to `latest`
        parameters = sum(p.ds_numel for p in model.parameters())  # ZeRO-3 keeps the full size here
        Path(out, "parameters.json").write_text(json.dumps({"parameters": parameters}))


def run_deepspeed(ckpt: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=True)
    queue.put({"seconds": time.perf_counter() - started, "peak_rss_mib": _peak_rss_mib()})


def run_lmforge(ckpt: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    from lmforge.export.consolidate import consolidate

    consolidate(Path(ckpt), Path(out))
    queue.put({"seconds": time.perf_counter() - started, "peak_rss_mib": _peak_rss_mib()})


def compare(a: str, b: str, queue) -> None:  # type: ignore[no-untyped-def]
    """Same names and bit-identical tensors, one tensor at a time."""
    import torch
    from safetensors import safe_open

    def tensors(root: str) -> dict[str, Path]:
        return {
            name: file
            for file in Path(root).glob("*.safetensors")
            for name in safe_open(str(file), "pt").keys()  # noqa: SIM118 (a safe_open handle, not a dict)
        }

    left, right = tensors(a), tensors(b)
    same = set(left) == set(right)
    for name in sorted(left.keys() & right.keys()):
        with safe_open(str(left[name]), "pt") as x, safe_open(str(right[name]), "pt") as y:
            same = same and torch.equal(x.get_tensor(name), y.get_tensor(name))
    queue.put({"identical": same, "tensors": len(left)})


def warm(root: Path) -> None:
    for file in root.rglob("*.pt"):
        with file.open("rb") as handle:
            while handle.read(64 << 20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", help=argparse.SUPPRESS)  # internal: the torchrun worker
    opts = parser.parse_args()
    if opts.write:
        write_checkpoint(opts.write, opts.hidden, opts.layers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = root / "ckpt"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29651",
             __file__, "--write", str(ckpt), "--hidden", str(opts.hidden), "--layers", str(opts.layers)],
            check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        size = sum(f.stat().st_size for f in ckpt.rglob("*.pt"))
        parameters = json.loads((ckpt / "parameters.json").read_text())["parameters"]
        print(
            f"checkpoint: ZeRO-3, 2 ranks, about {parameters / 1e6:.0f}M parameters, {size / 1e9:.2f} GB "
            f"of rank files, written in {time.perf_counter() - started:.0f} s"
        )
        runs: dict[str, list[dict]] = {"deepspeed": [], "lmforge": []}
        for repeat in range(opts.repeats):
            for side, target in (("deepspeed", run_deepspeed), ("lmforge", run_lmforge)):
                warm(ckpt)
                runs[side].append(measure(target, str(ckpt), str(root / f"{side}{repeat}")))
        check = measure(compare, str(root / "deepspeed0"), str(root / "lmforge0"))
        print(f"outputs identical: {check['identical']} ({check['tensors']} tensors)")
        medians = medians_by_side(runs, width=9)
        print(
            f"lmforge / zero_to_fp32: time {medians['lmforge'][0] / medians['deepspeed'][0]:.2f}x (goal <= 1.0x), "
            f"peak RSS {medians['lmforge'][1] / medians['deepspeed'][1]:.2f}x (goal <= 0.5x)"
        )


if __name__ == "__main__":
    main()
