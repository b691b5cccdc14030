#!/bin/bash
# once the arm ends: its adapters as they would ship (bf16) outside the checkout, merged, the gate (defaults) on two threads
cd /work/main
while pgrep -f "run /work/runs/onpolicy/arm" > /dev/null; do sleep 10; done
date
ship=/work/runs/onpolicy/ship_arm
.venv/bin/python -m builder.train ship-adapters --adapters /work/runs/onpolicy/arm/adapters --to $ship
.venv/bin/python -m builder.train merge-adapters --base build/checkpoints/smollm2 --adapters $ship \
  --out /work/runs/onpolicy/merged_arm
.venv/bin/python -m builder.evaluate_conversion --dualend /work/runs/onpolicy/merged_arm --adapters $ship \
  --reports /work/runs/onpolicy/gate_arm --threads 2 > /work/runs/onpolicy/gate_arm.log 2>&1
date
echo "gate done"
