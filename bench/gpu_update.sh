#!/usr/bin/env bash
# The trainer half on one GPU, as issues 42 and 44 measure it: bench/train_step.py --shape at
# Qwen2.5-1.5B (FSDP2 on one rank, the one-rank path, top_p 0.9 on peaked logits, each group's
# prompt shared; with the profiler's matmul share and top ops), rank-64 LoRA at Qwen2.5-7B, and
# Qwen2.5-3B (FSDP2, the one-rank path); then the packed mask and the head at top_p alone. Arms
# run in the order named, the most wanted first (the top_p ratio, issue 42's one open figure,
# printed as soon as its arm ends), so a timeout cuts the least. Exits 1 if any line failed.
# Run from the repo root on a machine with torch >= 2.6 and transformers >= 4.56 (no SGLang
# needed); logs go to $OUT. SHAPES=tiny ATTENTION=sdpa runs every line at the tiny shape (the dry
# run on a CPU).
set -u -o pipefail  # a timed-out or failed bench shows its status, not grep's or tee's
OUT=${OUT:-runs/gpu-update}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
bench() {  # seconds, log name, then train_step.py's arguments
    local seconds=$1 log=$2
    shift 2
    timeout "$seconds" python3 bench/train_step.py --repeats 1 "$@" 2>&1 \
        | grep -v -e Warning -e 'warnings.warn' | tee "$OUT/$log.log"
    local status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || echo "bench: $log ended with status $status (124: past its ${seconds} s)"
    [ "$status" = 0 ] || failed=1
}
failed=0
tiny=${SHAPES:-}
bench "${SECONDS_1_5B:-320}" shape-1.5b --shape "${tiny:-qwen2.5-1.5b}" --fsdp --profile \
    --arms "top_p-peaked,now-${ATTENTION:-flex_attention},fsdp,shared"
bench "${SECONDS_7B:-130}" lora-7b --shape "${tiny:-qwen2.5-7b}" --lora 64 --arms lora
bench "${SECONDS_3B:-90}" shape-3b --shape "${tiny:-qwen2.5-3b}" --top-p 1 --fsdp \
    --arms "fsdp,now-${ATTENTION:-flex_attention}"
# the packed update's FlexAttention mask, built both ways (update.document_mask against torch's
# create_block_mask over every token pair), up to the 47,104-token auto budget
timeout "${SECONDS_MASK:-30}" python3 bench/block_mask.py 2>&1 | grep -v -e Warning -e warn \
    | tee "$OUT/block-mask.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "bench: block-mask failed"; failed=1; }
# the output head alone, top_p 0.9 against top_p 1 on peaked logits (loss.nucleus_slots): bf16 at
# Qwen2.5-1.5B's hidden size and vocabulary (the dry run: fp32 on the CPU)
if [ -n "$tiny" ]; then head=(--tokens 256); else
    head=(--device cuda --dtype bfloat16 --hidden 1536 --tokens 16384 --chunk 1024); fi
timeout "${SECONDS_HEAD:-20}" python3 bench/nucleus_head.py "${head[@]}" 2>&1 \
    | tee "$OUT/nucleus-head.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "bench: nucleus-head failed"; failed=1; }
exit $failed
