"""Write a real FSDP2 torch-DCP checkpoint: `fully_shard` on 2 gloo ranks, one AdamW step, `dcp.save`.

Run under `torchrun --nproc_per_node 2 tests/dist_scripts/write_fsdp_checkpoint.py BASE OUT`
where BASE is an HF model directory with its tokenizer. Writes OUT/dcp/ (model and optimizer
state as DTensors, the way torchtitan-style loops save), OUT/config.json and the tokenizer next
to it, OUT/reference.safetensors (the full unsharded weights, gathered by torch's own
get_model_state_dict) and OUT/shards.json (elements each rank held, to prove it was sharded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(base: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = (torch.arange(2 * 16).reshape(2, 16) * 5 + rank) % model.config.vocab_size
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()

    local = sum(p.to_local().numel() for p in model.parameters())
    held = [0] * dist.get_world_size()
    dist.all_gather_object(held, local)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(out / "dcp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(out / "reference.safetensors"))
        total = sum(p.numel() for p in model.parameters())
        (out / "shards.json").write_text(json.dumps({"held": held, "total": total}))
        model.config.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
