"""w8a8 exports of SmolLM2 whose calibration peaks carry relative noise of 1e-5 (about what fp32 rounding on
another CPU gives), and one unsmoothed: each one's held-out NLL against the fp32 export's (weight_precision's rows:
seed 1, 16 x 256 tokens), the France question's likeliest first tokens and its greedy answer.

    PYTHONPATH=. python reports/w8a8/near_tie_amd/calibration_noise.py FP32_EXPORT W8A8_EXPORT OUT_DIR
(the exports as `benchmarks.weight_precision --export-dir` leaves them; OUT_DIR a scratch folder)"""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks.weight_precision import first_tokens, held_out_rows, teacher_forced
from builder.export import CALIBRATION, calibration_rows, input_peaks, write_backbone_graph
from builder.quantize import quantize_per_channel
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.onnx_engine import OnnxComponents
from dualend.serving.offline import generate_text

QUESTION = "What is the capital of France?"
fp32_export, w8a8_export, scratch = (Path(arg) for arg in sys.argv[1:4])
checkpoint = load_checkpoint("build/checkpoints/smollm2")
model, tokenizer = checkpoint.model.eval(), checkpoint.tokenizer
peaks = input_peaks(model, calibration_rows(checkpoint, CALIBRATION))
rows = held_out_rows(checkpoint, 16, 256, 1)
fp32_nll, fp32_top = teacher_forced(fp32_export, rows, 1)
for arm in ["as built", "noise seed 1", "noise seed 2", "noise seed 3", "unsmoothed"]:
    out = scratch / arm.replace(" ", "_")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(w8a8_export, out)
    path = out / "backbone" / "model.onnx"
    write_backbone_graph(model, path)
    if arm == "unsmoothed":
        quantize_per_channel(path)
    else:
        rng = np.random.default_rng(int(arm[-1]) if arm.startswith("noise") else 0)
        noisy = {key: (value * (1 + 1e-5 * rng.standard_normal(value.shape))).astype(np.float32)
                 for key, value in peaks.items()} if arm.startswith("noise") else peaks
        quantize_per_channel(path, noisy, CALIBRATION["strength"])
    manifest_path = out / "backbone" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {name: hashlib.sha256((out / "backbone" / name).read_bytes()).hexdigest()
                         for name in manifest["files"]}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    nll, top = teacher_forced(out, rows, 1)
    likeliest = " ".join(f"{tokenizer.decode([t])!r} {v:.2f}" for t, v in first_tokens(out, QUESTION, 1)[:3])
    engine = OnnxComponents(out, 1, max_sequences=1)
    answer = generate_text(engine, tokenizer, tokenizer.user_turn(QUESTION), SamplingParams(max_tokens=12), 1.0).text
    print(f"{arm:>12}: NLL vs fp32 {nll.mean() - fp32_nll.mean():+.4f}, top-1 = fp32 {(top == fp32_top).mean():.3f}; "
          f"first tokens {likeliest}; answer {answer!r}", flush=True)
    shutil.rmtree(out)
