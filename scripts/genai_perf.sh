#!/usr/bin/env bash
# genai-perf 0.0.16 against a running server, unchanged (the ensembles speak the TensorRT-LLM
# backend's tensor names). It lives in its own virtualenv (.venv-genai): its dependencies pin other
# versions than the project's. Token counts use the tokenizer folder `builder.assemble` writes per deployment.
#   bash scripts/genai_perf.sh                                   # dualend, 256 in / 64 out, concurrency 8
#   MODEL=baseline CONCURRENCY=16 INPUT_TOKENS=896 bash scripts/genai_perf.sh
#   MODEL=smollm2 bash scripts/genai_perf.sh
# URL defaults to tritonserver's own gRPC port behind the gateway (127.0.0.1:18001, see dualend.ops.launch).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-genai/bin/genai-perf ] || {
    python3 -m venv .venv-genai
    .venv-genai/bin/pip install -q "genai-perf==0.0.16" "tritonclient[all]==2.51.0"
}
model=${MODEL:-dualend}
tokenizer=build/tokenizer/${model/#llm/dualend}   # the canary `llm` counts with the dual-end tokenizer
[ -f "$tokenizer/tokenizer.json" ] || { echo "genai_perf.sh: no $tokenizer; run .venv/bin/python -m builder.assemble" >&2; exit 1; }
source benchmarks/perf_env.sh   # perf_analyzer 2.51.0 on PATH, libcudart on LD_LIBRARY_PATH
out=${OUT:-build/genai-perf/$(date +%Y%m%d-%H%M%S)}
.venv-genai/bin/genai-perf profile -m "$model" --endpoint-type kserve --backend tensorrtllm \
    --streaming -u "${URL:-localhost:18001}" --tokenizer "$tokenizer" \
    --synthetic-input-tokens-mean "${INPUT_TOKENS:-256}" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "${OUTPUT_TOKENS:-64}" --extra-inputs ignore_eos:true \
    --concurrency "${CONCURRENCY:-8}" --measurement-interval "${INTERVAL_MS:-10000}" --artifact-dir "$out"
