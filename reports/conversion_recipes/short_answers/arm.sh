#!/bin/bash
# one arm of issue 31's short-answers A/B: from the shipped adapters, one thread, side by side
#   arm.sh NAME MINUTES [extra convert options]
cd /work/main
name=$1; minutes=$2; shift 2
.venv/bin/python -m builder.train convert --baseline build/checkpoints/smollm2 --run /work/runs/short31/$name \
  --init-adapters checkpoints/smollm2_dualend --mtp-layer-full --lora-rank 16 --compressor-init mean --lr 2.5e-5 \
  --warmup 20 --decay-minutes $minutes --batch-size 4 --seq-tokens 256 --time-limit-minutes $minutes --threads ${THREADS:-1} \
  --eval-rows 16 --eval-every 200 --hidden-weight 0 --chat-prompts 512 --open-prompts 1024 --chat-fraction 0.35 \
  --seed 13 --compile "$@"
