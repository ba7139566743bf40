#!/usr/bin/env bash
# The trainer half on one GPU, as issue 42 measures it: bench/train_step.py --shape at Qwen2.5-1.5B
# (the baseline, the shipped path, top_p 0.9 on peaked logits, FSDP2 on one rank with the parts
# compiled as shipped and with whole layers (parallel.as_plain_modules); with the profiler's matmul
# share) and at Qwen2.5-3B (the shipped path, and FSDP2). Run from the repo root on
# a machine with torch >= 2.6 and transformers >= 4.56 (no SGLang needed); logs go to $OUT.
set -u
OUT=${OUT:-runs/gpu-update}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout "${SECONDS_1_5B:-420}" python3 bench/train_step.py --shape qwen2.5-1.5b --repeats 1 --fsdp \
    --arms baseline,now-flex_attention,top_p-peaked,fsdp,fsdp-layer --profile 2>&1 | grep -v -e Warning -e warn | tee "$OUT/shape-1.5b.log"
timeout "${SECONDS_3B:-200}" python3 bench/train_step.py --shape qwen2.5-3b --repeats 1 --top-p 1 --fsdp \
    --arms now-sdpa,now-flex_attention,fsdp 2>&1 | grep -v -e Warning -e warn | tee "$OUT/shape-3b.log"
# the packed update's FlexAttention mask, built both ways (update.document_mask against torch's
# create_block_mask over every token pair), up to the 47,104-token auto budget
timeout "${SECONDS_MASK:-120}" python3 bench/block_mask.py 2>&1 | grep -v -e Warning -e warn \
    | tee "$OUT/block-mask.log"
