#!/bin/bash
# the gate (builder.evaluate_conversion defaults) on an arm's last adapters, merged outside the checkout
#   gate.sh NAME THREADS
cd /work/main
name=$1; threads=${2:-1}
.venv/bin/python -m builder.train merge-adapters --base build/checkpoints/smollm2 \
  --adapters /work/runs/short31/$name/adapters --out /work/runs/short31/merged_$name
.venv/bin/python -m builder.evaluate_conversion --dualend /work/runs/short31/merged_$name \
  --reports /work/runs/short31/gate_$name --threads $threads
PYTHONPATH=. .venv/bin/python reports/conversion_recipes/short_answers/stops.py /work/runs/short31/merged_$name > /work/runs/short31/stops_$name.txt
