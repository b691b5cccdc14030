"""How far the w8a8 calibration's input peaks, computed in fp32 as builder.export computes them, are from the
same peaks computed in fp64 (relative difference over every input of every product).

    PYTHONPATH=. python reports/w8a8/near_tie_amd/peak_precision.py CHECKPOINT"""
import sys

import numpy as np
import torch

from builder.export import CALIBRATION, calibration_rows, input_peaks
from dualend.engine.checkpoint import load_checkpoint

checkpoint = load_checkpoint(sys.argv[1])
model, rows = checkpoint.model.eval(), calibration_rows(checkpoint, CALIBRATION)
with torch.no_grad():
    fp32 = input_peaks(model, rows)
    fp64 = input_peaks(model.double(), rows)  # the same keys: weight_key hashes the weight rounded to fp32
relative = np.concatenate([np.abs(fp32[key] - fp64[key]) / np.maximum(np.abs(fp64[key]), 1e-6) for key in fp32])
print(f"torch {torch.__version__}: {len(fp32)} products, {relative.size} input peaks; relative difference fp32 vs "
      f"fp64: median {np.median(relative):.1e}, 99th percentile {np.percentile(relative, 99):.1e}, "
      f"largest {relative.max():.1e}")
