# Sourced by scripts/test and scripts/demo: make .venv with kvgate and its dev extras, once per pyproject change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVGATE_VENV:-$ROOT/.venv}"

pick_python() {
    for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [[ -n "$candidate" ]] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "bootstrap: Python >= 3.11 is required and was not found" >&2
    return 1
}

stamp_of() { cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16; }

if [[ ! -x "$VENV/bin/python" ]]; then
    PY="$(pick_python)"
    echo "bootstrap: creating $VENV with $PY" >&2
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.kvgate-installed-$(stamp_of)"
if [[ ! -f "$STAMP" ]]; then
    echo "bootstrap: installing kvgate[dev] into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]"
    rm -f "$VENV"/.kvgate-installed-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
