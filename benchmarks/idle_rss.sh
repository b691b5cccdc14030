#!/usr/bin/env bash
# Idle resident memory of a served repository (docs/benchmarks.md#idle-memory): serves it behind the
# gateway, waits until /v1/models lists LAST_MODEL and 20 s more, and prints the RSS of tritonserver
# and its Python stubs (summed from ps) with the largest processes. No request is sent.
#   bash benchmarks/idle_rss.sh [REPOSITORY [LAST_MODEL]]   # default: build/model_repository, smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
repository=${1:-build/model_repository}
last_model=${2:-smollm2}
source benchmarks/serve_for_benchmark.sh
serve_for_benchmark "$repository" "$last_model" build/bench_gateway/server_idle_rss.log
sleep 20
ps -eo rss,args | awk '/tritonserver|triton_python_backend_stub/ && !/awk/' | sort -rn > build/bench_gateway/idle_rss_ps.txt
awk '{n++; s+=$1} END {printf "%s: %d processes, RSS %d MiB\n", "'"$repository"'", n, s/1024}' build/bench_gateway/idle_rss_ps.txt
head -4 build/bench_gateway/idle_rss_ps.txt | awk '{printf "  %6d MiB  %s\n", $1/1024, substr($0, index($0, $2), 140)}'
