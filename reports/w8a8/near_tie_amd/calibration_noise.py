"""w8a8 exports of SmolLM2 made again with their calibration peaks times (1 + NOISE x a standard normal draw, 1e-5
unless given), and one unsmoothed:
each one's held-out NLL against the fp32 export's (weight_precision's rows: seed 1, 16 x 256 tokens), the France
question's likeliest first tokens and its greedy answer. Both backbone graphs are rebuilt as builder.export builds
them (quantize_graph with the export's own weight_quantization), the rest of the export copied.

    PYTHONPATH=. python reports/w8a8/near_tie_amd/calibration_noise.py \
        CHECKPOINT FP32_EXPORT W8A8_EXPORT SCRATCH [NOISE]
(the exports as `benchmarks.weight_precision --export-dir` leaves them; SCRATCH a folder it may empty)"""
import shutil
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from benchmarks.weight_precision import first_tokens, held_out_rows, teacher_forced
from builder.export import calibration_rows, input_peaks, quantize_graph, write_backbone_graph
from dualend.engine.checkpoint import load_checkpoint
from dualend.engine.decode import SamplingParams
from dualend.engine.manifest import write_manifest
from dualend.engine.onnx_engine import VERIFY_FILE, ExportedModel, OnnxComponents
from dualend.serving.offline import generate_text

QUESTION = "What is the capital of France?"
checkpoint_dir, fp32_export, w8a8_export, scratch = (Path(arg) for arg in sys.argv[1:5])
noise = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-5
checkpoint = load_checkpoint(checkpoint_dir)
model, tokenizer = checkpoint.model.eval(), checkpoint.tokenizer
built = ExportedModel.open(w8a8_export)
quantization = built.settings["weight_quantization"]
peaks = input_peaks(model, calibration_rows(checkpoint, quantization["calibration"]))
rows = held_out_rows(checkpoint, 16, 256, 1)
fp32_nll, fp32_top = teacher_forced(fp32_export, rows, 1)
print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; noise {noise:g}")


def arm_peaks(arm: str) -> dict | None:
    if arm == "unsmoothed":
        return None
    if arm == "as built":
        return peaks
    rng = np.random.default_rng(int(arm.rsplit(" ", 1)[1]))
    return {key: (value * (1 + noise * rng.standard_normal(value.shape))).astype(np.float32)
            for key, value in peaks.items()}


for arm in ["as built", "noise seed 1", "noise seed 2", "noise seed 3", "unsmoothed"]:
    out = scratch / arm.replace(" ", "_")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(w8a8_export, out)
    backbone = out / "backbone"
    for path, verify in ((built.path("backbone").relative_to(w8a8_export), False),
                         (Path("backbone") / VERIFY_FILE, True)):
        write_backbone_graph(model, out / path, verify=verify)
        quantize_graph(out / path, quantization, checkpoint.config.vocab_size, peaks=arm_peaks(arm))
    write_manifest(backbone, built.checkpoint_id, "backbone", "onnx", built.settings)
    nll, top = teacher_forced(out, rows, 1)
    likeliest = " ".join(f"{text!r} {value:.2f}" for _, text, value in first_tokens(out, QUESTION, 1, count=3))
    engine = OnnxComponents(out, 1, max_sequences=1)
    answer = generate_text(engine, tokenizer, tokenizer.user_turn(QUESTION), SamplingParams(max_tokens=12), 1.0).text
    print(f"{arm:>12}: NLL vs fp32 {nll.mean() - fp32_nll.mean():+.4f}, top-1 = fp32 {(top == fp32_top).mean():.3f}; "
          f"first tokens {likeliest}; answer {answer!r}", flush=True)
    shutil.rmtree(out)
