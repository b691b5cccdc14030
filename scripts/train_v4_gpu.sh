#!/usr/bin/env bash
# Model v4 on one GPU, about twelve minutes: the shipped v3 baseline trained further,
# then the shipped v3 dual-end model moved by what the baseline learned (task vectors) and trained
# against it, twice. Run from the repository root, with the v3 checkpoints at V3 (a worktree of
# commit a791464: `git worktree add v3 a791464`): scripts/train_v4_gpu.sh RUNS_DIR v3/checkpoints
set -euo pipefail
runs=${1:?usage: scripts/train_v4_gpu.sh RUNS_DIR V3_CHECKPOINTS}
v3=${2:?usage: scripts/train_v4_gpu.sh RUNS_DIR V3_CHECKPOINTS}
python=${PYTHON:-python3}
gpu=(--device cuda --data-workers 10 --threads 6 --batch-size 64 --eval-every 1500 --patience 100)
export PYTHONUNBUFFERED=1
$python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
$python -m builder.train baseline --init-from "$v3/baseline" --run "$runs/baseline_v8_gpu" \
    --steps 30000 --lr 1e-3 --warmup 100 --seed 9 --time-limit-minutes 3.6 "${gpu[@]}"
$python -m builder.train merge --dualend "$v3/dualend" --baseline-before "$v3/baseline" \
    --baseline-after "$runs/baseline_v8_gpu/best" --out "$runs/dualend_merged_v8"
$python -m builder.train dualend --baseline "$runs/baseline_v8_gpu/best" --init-from "$runs/dualend_merged_v8" \
    --run "$runs/dualend_v8_gpu" --steps 30000 --lr 7e-4 --warmup 100 --seed 10 --time-limit-minutes 3.4 "${gpu[@]}"
# The shipped dual-end model: the run above continued from its best checkpoint, at a lower rate
# (run as a second call on the same machine, about four minutes).
$python -m builder.train dualend --baseline "$runs/baseline_v8_gpu/best" --init-from "$runs/dualend_v8_gpu/best" \
    --run "$runs/dualend_v8b_gpu" --steps 30000 --lr 4e-4 --warmup 50 --seed 11 --time-limit-minutes 3.7 "${gpu[@]}"
