#!/usr/bin/env bash
# The GPU checks in one run on one CUDA GPU (about 6 minutes on a lent H200). All three were open
# until 2026-11-28 and are now recorded in bench/RESULTS.md; the script stays as their re-run:
#   1. paged 32-bit and 8-bit AdamW follow torch AdamW's curve and resume after SIGKILL;
#   2. paged 8-bit AdamW's tokens/s and peak memory on the ~1.07B Llama beside the bare HF Trainer;
#   3. lmforge with Liger vs the HF Trainer with its own `use_liger_kernel=True` at micro-batch 12.
# Still unmeasured, for want of the package on the lent machine (neither can be fetched there nor fits
# a 64 MiB transfer): varlen flash attention (flash-attn) and generation in vLLM.
#
#   bash bench/gpu_open_items.sh OUT_DIR
#
# Each step has its own time cap (S1_S, S2_S, S3_S seconds, then SIGKILL to its process group;
# 200 + 200 + 200 by default), so the script ends inside a lease's one call (600 s) however a step
# behaves. `python` is whichever of python / python3 exists (the lent machine has python3 only).
# The lent machine lacks some of lmforge's dependencies and cannot fetch: carry them as wheels in
# `.whl/` (transformers 5.23, TRL, peft, datasets + dill + multiprocess, pydantic + pydantic-core +
# annotated-types + typing-inspection, torchdata, liger-kernel, bitsandbytes with its CUDA 11/12 and
# ROCm libraries deleted: `zip -d bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so'
# 'bitsandbytes/libbitsandbytes_rocm*'`, 26 MiB in all) and start the call with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src:$PWD
set -uo pipefail
out=${1:?usage: bash bench/gpu_open_items.sh OUT_DIR}
source "$(dirname "$0")/gpu_common.sh"

capped "${S1_S:-200}" "$python" -m pytest -m gpu tests/test_gpu.py -q -s -k paged 2>&1 |
    tee "$out/gpu_tests.log" | tail -5

# Llama-3.2-1B's layers with a 32k vocabulary (1.07B parameters).
one_b='{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8}'
capped "${S2_S:-200}" "$python" bench/gpu_fast_path.py --out "$out/mfu_1b" --steps 30 --warmup 10 --batch 8 \
    --model-config "$one_b" --variants bare,paged_adamw_8bit 2>&1 | tee "$out/mfu_1b.log" | tail -3
capped "${S3_S:-200}" "$python" bench/gpu_fast_path.py --out "$out/mfu_1b_b12" --steps 30 --warmup 10 --batch 12 \
    --model-config "$one_b" --variants liger,bare_liger 2>&1 | tee "$out/mfu_1b_b12.log" | tail -3
echo "logs: $out/*.log; the MFU rows: $out/mfu_1b*/results.jsonl"
