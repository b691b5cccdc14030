#!/usr/bin/env bash
# Load-test a running server with perf_analyzer 2.51.0 over gRPC streaming (the model is decoupled).
#   bash perf_analyzer_configs/run.sh                 # dualend, concurrency 1..8
#   MODEL=baseline CONCURRENCY=1:4 bash perf_analyzer_configs/run.sh
# Prompts: held-out task prompts in inputs.json (written from dualend.data.eval_set).
set -euo pipefail
cd "$(dirname "$0")/.."
source client/perf_env.sh
perf_analyzer -m "${MODEL:-dualend}" -u "${URL:-127.0.0.1:8001}" -i grpc --streaming \
    --input-data perf_analyzer_configs/inputs.json \
    --concurrency-range "${CONCURRENCY:-1:8:2}" \
    --measurement-interval "${INTERVAL_MS:-8000}" --stability-percentage 50 \
    --profile-export-file "${EXPORT:-build/perf_${MODEL:-dualend}.json}"
