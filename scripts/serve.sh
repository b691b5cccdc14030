#!/usr/bin/env bash
# Sets up .venv, builds the model repository if it is missing, and serves it (gateway included).
#   bash scripts/serve.sh [launcher flags, e.g. --baseline-percent 10]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -d build/model_repository ] || .venv/bin/python -m builder.assemble
exec .venv/bin/python -m dualend.ops.launch "$@"
