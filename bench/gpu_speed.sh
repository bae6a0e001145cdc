#!/usr/bin/env bash
# Issue 40's GPU measurements in one run on one CUDA GPU (about 9 minutes on a lent H200):
#   1. a ~1.07B Llama (Llama-3.2-1B's layers, 32k vocabulary) full training at micro-batch 12, seq 2048:
#      the HF Trainer with `use_liger_kernel=True` (and with `torch_compile=True` beside it) vs lmforge
#      with Liger + regional compile (`train.compile: layers`), in bf16 and in FP8 (torchao tensorwise);
#      tokens/s, MFU, peak memory (bench/gpu_fast_path.py, one process per variant);
#   2. the FP8 loss curve against bf16's over 200 steps on a ~0.4B Llama (same data, seed, batch);
#   3. lmforge's step overhead against the bare HF Trainer at log every step, on the 110M Llama the
#      2026-11-24 figure (0.877x) came from: the guardrails' verdict is now taken on the device.
#
#   bash bench/gpu_speed.sh OUT_DIR
#
# Each step has its own time cap (S1_S, S2_S, S3_S seconds, then SIGKILL to its process group), so the
# script ends inside a lease's one call (600 s). The lent machine lacks some of lmforge's dependencies:
# carry them as wheels in `.whl/` (see bench/gpu_open_items.sh; torchao 0.18.0 for FP8) and start with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src:$PWD
set -uo pipefail
out=${1:?usage: bash bench/gpu_speed.sh OUT_DIR}
source "$(dirname "$0")/gpu_common.sh"

one_b='{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8}'
capped "${S1_S:-330}" "$python" bench/gpu_fast_path.py --out "$out/speed_1b" --steps 30 --warmup 10 --batch 12 \
    --model-config "$one_b" --variants bare_liger,liger+layers,fp8+liger+layers,bare_liger_compile 2>&1 |
    tee "$out/speed_1b.log" | grep -v '^ *File\|^  ' | tail -8

small='{"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 4}'
capped "${S2_S:-150}" "$python" bench/gpu_fast_path.py --out "$out/curve_fp8" --steps 200 --warmup 20 --batch 8 \
    --model-config "$small" --variants liger+layers,fp8+liger+layers 2>&1 |
    tee "$out/curve_fp8.log" | grep -v '^ *File\|^  ' | tail -4

capped "${S3_S:-100}" "$python" bench/train_overhead.py --steps 200 --warmup 20 --repeats 2 --log-every 1 \
    --precision bf16 --seq-len 1024 --model-config '{"hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12}' 2>&1 |
    tee "$out/overhead.log" | tail -4
echo "rows: $out/speed_1b/results.jsonl, $out/curve_fp8/results.jsonl; logs: $out/*.log"
