#!/usr/bin/env bash
# The SmolLM2 comparison in one run (docs/benchmarks.md#smollm2-against-its-peers): builds a benchmark
# repository with the variants below, serves it behind the gateway with a key of its own, and runs
# benchmarks.compare against it, llama.cpp's server, ONNX Runtime GenAI and our in-process engine.
# Nothing else may run on the machine meanwhile (no training): benchmarks.compare refuses to start while
# the load average stays above 0.5. Peers first: bash scripts/install_peers.sh
#   bash benchmarks/compare_smollm2.sh                     # -> reports/compare_smollm2/
#   ROUNDS=2 REQUESTS=2 bash benchmarks/compare_smollm2.sh # steadier figures (about 100 minutes on 2 cores)
# Served deployments (build/bench_repository), every one through the same gateway and /v1 routes:
#   smollm2_exact           the token-level model, fp32 (the reference of the ratios)
#   smollm2                 the same, 8-bit weights and activations (w8a8, the default build's)
#   smollm2_int4            the same, weights int4 on the GGUF's own Q4_1 blocks (reports/weight_precision_nll.txt)
#   smollm2_dualend         the converted pair model at its calibrated threshold (its real acceptance)
#   smollm2_dualend_syn70/90  the same, drafts accepted by a seeded draw at 0.7 / 0.9 (SYNTHETIC ACCEPTANCE)
#   smollm2_dualend_int8_syn90  int8 weights and synthetic acceptance 0.9
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-reports/compare_smollm2}
repository=build/bench_repository
.venv/bin/python -m builder.assemble --out "$repository" --deployments smollm2 smollm2_exact smollm2_dualend \
    --variant smollm2_int4=smollm2 --weight-precision smollm2_int4=int4 \
    --variant smollm2_dualend_syn70=smollm2_dualend --synthetic-acceptance smollm2_dualend_syn70=0.7 \
    --variant smollm2_dualend_syn90=smollm2_dualend --synthetic-acceptance smollm2_dualend_syn90=0.9 \
    --variant smollm2_dualend_int8_syn90=smollm2_dualend --synthetic-acceptance smollm2_dualend_int8_syn90=0.9 \
    --weight-precision smollm2_dualend_int8_syn90=int8 --kv-cache-mb 1024 --max-concurrent-requests 16
source benchmarks/serve_for_benchmark.sh
serve_for_benchmark "$repository" int8_syn90 build/bench_gateway/server.log
targets=()
for model in smollm2_exact smollm2 smollm2_int4 smollm2_dualend smollm2_dualend_syn70 smollm2_dualend_syn90 smollm2_dualend_int8_syn90; do
    targets+=(--openai "$model=http://127.0.0.1:8000/v1@$model")
done
common=(--reference smollm2_exact --rounds "${ROUNDS:-1}" --requests "${REQUESTS:-1}" "${targets[@]}" --llama-server --ortgenai)
.venv/bin/python -m benchmarks.compare "${common[@]}" --workloads prompt-heavy decode-heavy --concurrency 1 4 16 \
    --in-process "engine_syn90=build/export/smollm2_dualend@synthetic=0.9@threshold=0.2" --out "$out/throughput"
.venv/bin/python -m benchmarks.compare "${common[@]}" --workloads ttft-2048 --concurrency 1 --out "$out/ttft"
