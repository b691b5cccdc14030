#!/usr/bin/env bash
# Concurrency sweep with perf_analyzer 2.51.0 over gRPC streaming against a running server, both
# deployments back to back at each concurrency, then TTFT, inter-token latency and throughput
# (p50/p90/p99) from the profile exports (benchmarks/perf_report.py).
#   bash perf_analyzer_configs/run.sh                                   # fixed_256 at 1 4 16 32
#   WORKLOAD=fixed_896 CONCURRENCY="1 16" bash perf_analyzer_configs/run.sh
#   MODELS=dualend URL=127.0.0.1:18001 REQUESTS=64 OUT=build/perf/mine bash perf_analyzer_configs/run.sh
# Workloads (python -m benchmarks.perf_inputs writes them): fixed_256, fixed_512, fixed_896,
# prompt_heavy, generation_heavy; all stream with ignore_eos inside the trained context.
# URL is tritonserver's own gRPC port behind the gateway (python -m dualend.ops.launch puts it on
# 127.0.0.1:18001): perf_analyzer cannot send the gateway's API key over gRPC (its -H is HTTP only).
# Each run writes to a new folder (perf_analyzer refuses an export path that exists).
# Windows are counted in requests (REQUESTS, default max(16, 2 x concurrency)), so a slow long
# request never leaves a window empty. --stability-percentage 999: these 2-core machines never hold
# throughput within perf_analyzer's default 10%; the figures come from the exported windows.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/perf_env.sh
workload=${WORKLOAD:-fixed_256}
out=${OUT:-build/perf/$(date +%Y%m%d-%H%M%S)-$workload}
mkdir -p "$out"
for concurrency in ${CONCURRENCY:-1 4 16 32}; do
    for model in ${MODELS:-dualend baseline}; do
        echo "perf_analyzer: $model, $workload, concurrency $concurrency -> $out/${model}_c${concurrency}.json"
        requests=${REQUESTS:-$(( concurrency * 2 > 16 ? concurrency * 2 : 16 ))}
        perf_analyzer -m "$model" -u "${URL:-127.0.0.1:18001}" -i grpc --streaming \
            --input-data "perf_analyzer_configs/$workload.json" --concurrency-range "$concurrency" \
            --measurement-mode count_windows --measurement-request-count "$requests" \
            --stability-percentage 999 --max-trials 3 \
            --profile-export-file "$out/${model}_c${concurrency}.json" > "$out/${model}_c${concurrency}.log"
    done
done
python -m benchmarks.perf_report "$out"/*_c*.json --json "$out/summary.json"
