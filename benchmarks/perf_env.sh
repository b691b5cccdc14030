# Environment for perf_analyzer 2.51.0 (from the tritonclient==2.51.0 wheel) on a CPU-only machine.
#
# Usage (bash or zsh, from anywhere):
#   source benchmarks/perf_env.sh
#   perf_analyzer --version
#   perf_analyzer -m ensemble -u 127.0.0.1:8001 -i grpc --streaming ...
#
# perf_analyzer links libb64.so.0d (Debian/Ubuntu package libb64-0d: apt-get install -y libb64-0d)
# and libcudart.so.12 (pip package nvidia-cuda-runtime-cu12, pinned in requirements-serving.txt).
# The virtualenv is $DUALEND_VENV, else the active $VIRTUAL_ENV, else <repo>/.venv.
# Note: `perf_analyzer --help` prints the usage but exits with code 99; `--version` exits 0.

_dualend_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
_dualend_venv="${DUALEND_VENV:-${VIRTUAL_ENV:-$_dualend_repo/.venv}}"
_dualend_cudart="$("$_dualend_venv/bin/python" -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))' 2>/dev/null)"

if [ -z "$_dualend_cudart" ] || [ ! -e "$_dualend_cudart/libcudart.so.12" ]; then
    echo "perf_env.sh: libcudart.so.12 not found in $_dualend_venv; pip install -r requirements-serving.txt" >&2
elif ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
    echo "perf_env.sh: libb64.so.0d not found; apt-get install -y libb64-0d" >&2
fi

if [ -n "$_dualend_cudart" ]; then
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$_dualend_cudart:"*) ;;
        *) export LD_LIBRARY_PATH="$_dualend_cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
fi
case ":$PATH:" in
    *":$_dualend_venv/bin:"*) ;;
    *) export PATH="$_dualend_venv/bin:$PATH" ;;
esac
unset _dualend_repo _dualend_venv _dualend_cudart
