#!/usr/bin/env bash
# Verified drafts on SmolLM2 in one run (docs/benchmarks.md#verified-drafts-on-smollm2): builds a benchmark
# repository with smollm2 and smollm2_mtp at their default precision (w8a8) and in int4, serves it behind the gateway, and runs
# benchmarks.compare (decode-heavy, one and 16 streams; llama.cpp's llama-server too once
# scripts/install_peers.sh built it), then benchmarks.draft_acceptance in-process on held-out chat prompts.
# Nothing else may run meanwhile (benchmarks.compare refuses a load average above 0.5).
#   bash benchmarks/verified_drafts_smollm2.sh             # -> reports/verified_drafts_smollm2/
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-reports/verified_drafts_smollm2}
repository=build/bench_repository_mtp
mkdir -p "$out"
.venv/bin/python -m builder.assemble --out "$repository" --deployments smollm2 smollm2_mtp \
    --variant smollm2_int4=smollm2 --weight-precision smollm2_int4=int4 \
    --variant smollm2_mtp_int4=smollm2_mtp --weight-precision smollm2_mtp_int4=int4 \
    --kv-cache-mb 1024 --max-concurrent-requests 16
source benchmarks/serve_for_benchmark.sh
serve_for_benchmark "$repository" smollm2_mtp_int4 build/bench_gateway/server_mtp.log
targets=()
for model in smollm2 smollm2_mtp smollm2_int4 smollm2_mtp_int4; do
    targets+=(--openai "$model=http://127.0.0.1:8000/v1@$model")
done
peers=()
[ -x build/peers/bin/llama-server ] && peers+=(--llama-server)
.venv/bin/python -m benchmarks.compare --reference smollm2 --rounds "${ROUNDS:-2}" --requests "${REQUESTS:-1}" \
    "${targets[@]}" "${peers[@]}" --workloads decode-heavy chat --concurrency 1 16 --out "$out/throughput"
kill -TERM $server; wait $server 2>/dev/null || true
trap - EXIT
for precision in _w8a8 _int4; do
    .venv/bin/python -m benchmarks.draft_acceptance --base "build/export/smollm2$precision" \
        --drafting "build/export/smollm2_mtp$precision" --prompts 16 --thresholds 0 0.3 | tee "$out/acceptance$precision.txt"
done
