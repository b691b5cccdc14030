#!/usr/bin/env bash
# Where a served deployment's processes spend their time while streams decode (issue 32, item 1): serves
# a benchmark repository behind the gateway, starts STREAMS greedy streams of MAX_TOKENS tokens (EOS
# ignored) on DEPLOYMENT through /v1, and once they run records each of its Python stubs (mtp_verify,
# backbone, postprocessing, compressor) with py-spy for DURATION seconds; then benchmarks.profile_summary
# prints each process's busy share by thread and function, and benchmarks.process_cpu (over the same
# window) the CPU time a streamed token costs in each process of the pipeline (PYSPY=0: that alone,
# without py-spy's own load). Needs py-spy (installed under build/tools if
# missing) and a repository holding DEPLOYMENT (benchmarks/verified_drafts_smollm2.sh builds one).
# Nothing else may run meanwhile.
#   DEPLOYMENT=smollm2_int4 STREAMS=1 bash benchmarks/served_profile.sh     # -> build/served_profile/
set -euo pipefail
cd "$(dirname "$0")/.."
repository=${REPOSITORY:-build/bench_repository_mtp}
deployment=${DEPLOYMENT:-smollm2_int4}
streams=${STREAMS:-1}
duration=${DURATION:-8}
rate=${RATE:-250}
out=${OUT:-build/served_profile}/${deployment}_c${streams}
pyspy=$(command -v py-spy || true)
if [ -z "$pyspy" ] && [ "${PYSPY:-1}" != 0 ]; then
    [ -x build/tools/py-spy/bin/py-spy ] || .venv/bin/python -m pip install -q --target build/tools/py-spy py-spy
    pyspy=build/tools/py-spy/bin/py-spy
fi
mkdir -p "$out"
source benchmarks/serve_for_benchmark.sh
serve_for_benchmark "$repository" "$deployment" "$out/server.log"
body=$(printf '{"model":"%s","prompt":"def fibonacci(n):","max_tokens":%d,"ignore_eos":true,"stream":true,"temperature":0}' \
    "$deployment" "${MAX_TOKENS:-1500}")
rm -f "$out"/stream_*.sse
for i in $(seq "$streams"); do
    curl -sN -H "Authorization: Bearer $DUALEND_API_KEY" -H 'Content-Type: application/json' \
        localhost:8000/v1/completions -d "$body" > "$out/stream_$i.sse" &
done
sleep 5  # past the prompts' prefill
recorders=()
for step in $([ "${PYSPY:-1}" = 0 ] || echo mtp_verify backbone postprocessing compressor); do
    pid=$(pgrep -f "triton_python_backend_stub .*/${deployment}_v[0-9]*_${step}/" | head -1 || true)
    if [ -z "$pid" ]; then
        echo "no stub of ${deployment}'s ${step}" >&2
        continue
    fi
    "$pyspy" record --pid "$pid" --duration "$duration" --rate "$rate" --format raw --nonblocking --threads \
        --output "$out/$step.txt" > /dev/null 2>&1 &
    recorders+=($!)
done
.venv/bin/python -m benchmarks.process_cpu --duration "$duration" --streams "$out/stream_*.sse" > "$out/process_cpu.txt" &
recorders+=($!)
wait "${recorders[@]}"
echo "# PYSPY=${PYSPY:-1} DEPLOYMENT=$deployment STREAMS=$streams MAX_TOKENS=${MAX_TOKENS:-1500} DURATION=$duration RATE=$rate bash benchmarks/served_profile.sh ($(date -u '+%Y-%m-%d %H:%M'), commit $(git rev-parse --short HEAD), load average $(cut -d' ' -f1 /proc/loadavg))" | tee "$out/summary.txt"
[ "${PYSPY:-1}" = 0 ] || .venv/bin/python -m benchmarks.profile_summary "$out"/mtp_verify.txt "$out"/backbone.txt "$out"/postprocessing.txt \
    "$out"/compressor.txt --rate "$rate" --duration "$duration" | tee -a "$out/summary.txt"
tee -a "$out/summary.txt" < "$out/process_cpu.txt"
