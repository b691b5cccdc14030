#!/bin/bash
# issue 31's on-policy arm: long2's state (the shipped adapters' run) resumed with chat.json's odd train answers
# the shipped model's own (student_answers.py); otherwise rank31's r16 recipe, two threads
#   arm.sh MINUTES
cd /work/main
run=/work/runs/onpolicy/arm
mkdir -p $run
cp /work/runs/short31/long2/{state.pt,log.jsonl,started_from.json} $run/
cp /work/runs/onpolicy/chat_student.json $run/chat.json
.venv/bin/python -m builder.train convert --baseline build/checkpoints/smollm2 --run $run \
  --init-adapters checkpoints/smollm2_dualend --mtp-layer-full --compressor-init mean --lr 1e-5 \
  --warmup 20 --decay-minutes $1 --batch-size 4 --seq-tokens 256 --time-limit-minutes $1 --steps 7425 --threads 2 \
  --eval-rows 16 --eval-every 200 --hidden-weight 0 --chat-prompts 512 --open-prompts 1024 --short-prompts 640 \
  --chat-fraction 0.35 --seed 13 --compile
