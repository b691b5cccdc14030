#!/usr/bin/env bash
# Start of the GPU image: build (or reuse from /cache) the TensorRT engines, then serve.
set -euo pipefail
cd /opt/dualend
export_dir=/cache/export
python3 -m builder.assemble --export-dir "$export_dir" --out /cache/onnx_repository > /dev/null  # the ONNX exports
if ! ls "$export_dir"/*/backbone/model.plan > /dev/null 2>&1; then
    python3 -m builder.tensorrt_build --export-dir "$export_dir"    # refuses to write a plan that fails parity
fi
python3 -m builder.assemble --engine tensorrt --export-dir "$export_dir" --out /cache/model_repository
exec python3 -m dualend.ops.launch --model-repository /cache/model_repository --no-source-check --host 0.0.0.0 \
    --api-keys /etc/dualend/api_keys "$@"
