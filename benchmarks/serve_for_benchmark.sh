# Sourced by the benchmark scripts: serve_for_benchmark REPOSITORY LAST_MODEL LOG starts the launcher on
# REPOSITORY behind the gateway with a key of its own (build/bench_gateway/api_keys, max_requests=64,
# exported as DUALEND_API_KEY), stops it when the script exits, and returns once /v1/models lists
# LAST_MODEL (the server exiting first fails the script).
serve_for_benchmark() {
    local repository=$1 last_model=$2 log=$3 keys=build/bench_gateway/api_keys
    mkdir -p "$(dirname "$keys")"
    [ -f "$keys" ] || { echo "bench $(openssl rand -hex 16) max_requests=64" > "$keys"; chmod 600 "$keys"; }
    DUALEND_API_KEY=$(awk '{print $2}' "$keys")
    export DUALEND_API_KEY
    .venv/bin/python -m dualend.ops.launch --model-repository "$repository" --api-keys "$keys" --log-file "$log" &
    server=$!
    trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        curl -sf -H "Authorization: Bearer $DUALEND_API_KEY" localhost:8000/v1/models | grep -q "$last_model" && return
        kill -0 $server 2>/dev/null || { echo "the server exited; see $log" >&2; exit 1; }
        sleep 2
    done
    echo "$last_model was not served after 20 minutes; see $log" >&2
    exit 1
}
