#!/usr/bin/env bash
# Multi-turn chat with and without the prefix cache, in one run (benchmarks.multi_turn): builds a
# repository with smollm2 twice, alike but for the prefix cache, serves it behind the gateway with a key
# of its own, and runs the conversations against both. Nothing else may run meanwhile (no training):
# the benchmark refuses to start while the load average stays above 0.5.
#   bash benchmarks/multi_turn_smollm2.sh                    # -> reports/multi_turn_smollm2/
#   ROUNDS=1 CONVERSATIONS=2 bash benchmarks/multi_turn_smollm2.sh   # a quicker look
#   SOAK_S=300 bash benchmarks/multi_turn_smollm2.sh  # then a 5-minute soak of 16 conversations (SOAK_CONVERSATIONS), cancellations mixed in
# Served deployments (build/bench_multi_turn), through the same gateway and /v1 routes:
#   smollm2                  the token-level model (w8a8 since 2026-12-05), the prefix cache on (16 entries, the default)
#   smollm2_nocache          the same, --prefix-cache-entries 0
#   smollm2_dualend(_nocache) the converted pair model at its calibrated threshold, likewise
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-reports/multi_turn_smollm2}
repository=build/bench_multi_turn
.venv/bin/python -m builder.assemble --out "$repository" --deployments smollm2 smollm2_dualend \
    --variant smollm2_nocache=smollm2 --prefix-cache-entries smollm2_nocache=0 \
    --variant smollm2_dualend_nocache=smollm2_dualend --prefix-cache-entries smollm2_dualend_nocache=0 \
    --max-concurrent-requests 16
source benchmarks/serve_for_benchmark.sh
serve_for_benchmark "$repository" smollm2_dualend_nocache build/bench_gateway/multi_turn_server.log
for model in smollm2 smollm2_dualend; do
    .venv/bin/python -m benchmarks.multi_turn --cached $model --uncached ${model}_nocache \
        --rounds "${ROUNDS:-3}" --conversations "${CONVERSATIONS:-4}" --out "$out/$model"
done
if [ -n "${SOAK_S:-}" ]; then
    .venv/bin/python -m benchmarks.multi_turn --cached smollm2 --soak-s "$SOAK_S" \
        --conversations "${SOAK_CONVERSATIONS:-16}" --out "$out/smollm2"
fi
