#!/usr/bin/env bash
# Everything kvgate checks and measures on a GPU, in one run (the results of the runs on a lent H200: docs/gpu/).
#
#   bash scripts/gpu-checks.sh OUT_DIR [BASE_DIR]
#
# with a Python that has torch and kvgate's dependencies (PYTHON, default python3; on the device machine the
# wheels travel in .whl/ and are installed to /tmp/site first) and this checkout on its path. For each of the
# agent's tiers (dram, nvme, shared), `bench.gpu_check` (the connector's CUDA paths against a real agent: pinning,
# bit-exact round trips, stream ordering, save / load GB/s); then `bench.gpu_copy` (the copier's staging path against
# raw pinned copies) at three staging-buffer sizes. BASE_DIR: another checkout whose agent is run side by side
# with this one's (each tier: this, base, this, base), to compare agents on the same machine in the same run.
# Writes OUT_DIR/gpu.log (everything printed) and OUT_DIR/gpu_check.json (every check's rows); exit status 1 if
# any check failed. GPU_CHECK_ARGS / GPU_COPY_ARGS: more arguments for each (a small shape, to try it on a CPU).
set -uo pipefail
out=${1:?usage: gpu-checks.sh OUT_DIR [BASE_DIR]}
base=${2:-}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
log=$out/gpu.log
: > "$log"
{
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,pcie.link.gen.max,pcie.link.width.max,driver_version \
        --format=csv
    echo "cores: $(nproc)"
    free -g | head -2
    "$py" -c "import torch, aiohttp; print('torch', torch.__version__, 'aiohttp', aiohttp.__version__)"
} 2>&1 | tee -a "$log"

valkey=$("$py" -c "from bench.procs import valkey_server_binary; print(valkey_server_binary())") || exit 2
agents=("this=$py")
if [[ -n $base ]]; then
    wrapper=$(mktemp -d)/base-python
    # the base checkout's packages first on the path, then the same dependencies
    printf '#!/bin/sh\nexec env PYTHONPATH="%s:%s" "%s" "$@"\n' "$(cd "$base" && pwd)" "${PYTHONPATH:-}" \
        "$(command -v "$py")" > "$wrapper"
    chmod +x "$wrapper"
    agents=("this=$py" "base=$wrapper" "this2=$py" "base2=$wrapper")
fi

failed=0
parts=()
for tier in dram nvme shared; do
    for agent in "${agents[@]}"; do
        name=${agent%%=*}
        part=$out/.check-$tier-$name.json
        echo "## gpu_check --tier $tier, agent: $name" | tee -a "$log"
        timeout 180 "$py" -m bench.gpu_check --tier "$tier" --agent-python "${agent#*=}" --valkey-server "$valkey" \
            --out "$part" ${GPU_CHECK_ARGS:-} 2>&1 | tee -a "$log" || failed=1
        parts+=("$part")
    done
done
for staging in 32 128 512; do
    echo "## gpu_copy --blocks 256 --staging-mib $staging" | tee -a "$log"
    timeout 90 "$py" -m bench.gpu_copy --blocks 256 --num-blocks 1024 --staging-mib "$staging" ${GPU_COPY_ARGS:-} 2>&1 \
        | tee -a "$log"
done

"$py" - "$out/gpu_check.json" "${parts[@]}" <<'EOF'
import json
import sys
from pathlib import Path

runs = []
for part in sys.argv[2:]:
    path = Path(part)
    if path.exists():
        tier, agent = path.stem.removeprefix(".check-").split("-", 1)
        runs.append({"tier": tier, "agent": agent, **json.loads(path.read_text())})
        path.unlink()
Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
EOF
exit $failed
