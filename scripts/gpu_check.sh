#!/usr/bin/env bash
# One call on a machine with an NVIDIA GPU: build the TensorRT backbone engines, check them against
# ONNX Runtime, run the GPU test and the engine benchmark on both engines; everything lands in one
# report folder ($OUT, default build/gpu_check/<time>), summarised in $OUT/README.md.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
command -v nvidia-smi > /dev/null || { echo "gpu_check.sh: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi > "$out/nvidia-smi.txt"
[ -x .venv/bin/python ] || bash scripts/setup.sh
# TensorRT 10.5 (the release in Triton 24.10) and a CUDA build of torch for the device buffers.
.venv/bin/pip install -q "tensorrt==10.5.0"
.venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || .venv/bin/pip install -q --force-reinstall --no-deps "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu126
P=.venv/bin/python
$P -m builder.assemble > "$out/assemble.txt"   # the ONNX exports
$P -m builder.tensorrt_build 2>&1 | tee "$out/tensorrt_build.txt"           # parity checked, plans written
$P -m pytest -m gpu -q 2>&1 | tee "$out/pytest_gpu.txt"
$P -m benchmarks.bench_engine --lengths 256 512 960 --repeats 5 --json "$out/bench_onnxruntime.json" \
    > "$out/bench_onnxruntime.txt" 2>&1
$P -m benchmarks.bench_engine --batch-sizes 1 4 16 32 --lengths 256 --repeats 3 > "$out/bench_batched_onnxruntime.txt" 2>&1
$P -m builder.assemble --engine tensorrt > "$out/assemble_tensorrt.txt"
$P -m benchmarks.bench_served --lengths 256 960 --repeats 5 > "$out/bench_served_tensorrt.txt" 2>&1 || true
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
    echo; echo '```'; head -15 "$out/nvidia-smi.txt"; echo '```'
    echo; echo "## TensorRT build and parity"; echo '```'; cat "$out/tensorrt_build.txt"; echo '```'
    echo; echo "## GPU tests"; echo '```'; tail -5 "$out/pytest_gpu.txt"; echo '```'
    echo; echo "## Engine benchmark (ONNX Runtime)"; echo '```'; tail -20 "$out/bench_onnxruntime.txt"; echo '```'
    echo; echo "## Batched decode loop (ONNX Runtime)"; echo '```'; tail -6 "$out/bench_batched_onnxruntime.txt"; echo '```'
    echo; echo "## Served, backbone on TensorRT"; echo '```'; tail -25 "$out/bench_served_tensorrt.txt"; echo '```'
} > "$out/README.md"
echo "gpu_check.sh: report in $out/README.md"
