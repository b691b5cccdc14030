#!/bin/bash
# long2's gate once it ends, on the adapters as they would ship (bf16): ship them to a folder outside the
# checkout, merge, the gate (two threads, 64 text rows) into reports/ (restored from git if they do not
# ship) with its serving settings in that folder, then the stop counts
cd /work/main
while pgrep -f "run /work/runs/short31/long2 " > /dev/null; do sleep 10; done
date
ship=/work/runs/short31/ship_long2
.venv/bin/python -m builder.train ship-adapters --adapters /work/runs/short31/long2/adapters --to $ship
.venv/bin/python -m builder.train merge-adapters --base build/checkpoints/smollm2 --adapters $ship \
  --out /work/runs/short31/merged_long2
.venv/bin/python -m builder.evaluate_conversion --dualend /work/runs/short31/merged_long2 --adapters $ship \
  --threads 2 > /work/runs/short31/gate_long2.log 2>&1
mkdir -p /work/runs/short31/gate_long2 && cp reports/quality_smollm2_dualend.* /work/runs/short31/gate_long2/
date
PYTHONPATH=. .venv/bin/python reports/conversion_recipes/short_answers/stops.py /work/runs/short31/merged_long2 \
  > /work/runs/short31/stops_long2.txt 2>&1
date
echo gate done
