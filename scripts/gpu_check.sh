#!/usr/bin/env bash
# CUDA check: k3-tiny and k3-small validated against PyTorch, then decode timed; one table at the end.
#
#   scripts/gpu_check.sh prepare   here, in the project's venv: compile both CUDA bundles into out/gpu
#                                  and fetch the IREE runtime wheel for the GPU machine's Python 3.12
#   scripts/gpu_check.sh           on the NVIDIA machine: a venv, the project, the checks (< 5 minutes)
#   scripts/gpu_check.sh prepare N / check N
#                                  also k3-tiny compiled for N GPUs (k3c compile --devices N: the routed
#                                  experts split over them) and validated on N GPUs
#
# The lent GPU machine has Python 3.12 with torch but no network, and iree-base-compiler's wheel
# (84 MB) is over what a call may carry (64 MiB), so the bundles are compiled here and out/gpu is
# carried. k3-small's 400 MB checkpoint does not travel either: its bundle refers to it by absolute
# path and hash, and the check writes the same seeded checkpoint there. Without out/gpu (a machine
# with network), the check installs everything and compiles the bundles itself.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1  # stdout and stderr land in the logs in the order printed
GPU=out/gpu
SMALL_CHECKPOINT=/tmp/k3c-gpu/k3-small
RUNTIME_WHEEL=iree-base-runtime==3.13.0
DEVICES=${2:-1}
[[ "$DEVICES" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: N must be a positive device count, got $DEVICES" >&2; exit 2; }

prepare() {
    set -e
    k3c compile --preset k3-tiny --target cuda -o "$GPU/k3-tiny-cuda"
    [ "$DEVICES" = 1 ] || k3c compile --preset k3-tiny --target cuda --devices "$DEVICES" -o "$GPU/k3-tiny-x$DEVICES-cuda"
    [ -d "$SMALL_CHECKPOINT" ] || k3c init-checkpoint --preset k3-small "$SMALL_CHECKPOINT"
    k3c compile --checkpoint "$SMALL_CHECKPOINT" --target cuda -o "$GPU/k3-small-cuda"
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$GPU/wheels" "$RUNTIME_WHEEL"
    du -sh "$GPU"
    echo "prepared: run scripts/gpu_check.sh on the GPU machine with out/gpu carried"
}

install() {
    python3 -m venv --system-site-packages /tmp/k3c-venv && . /tmp/k3c-venv/bin/activate || exit 1
    if [ -d "$GPU/wheels" ]; then
        pip install -q --no-index "$GPU"/wheels/*.whl &&
            pip install -q --no-deps --no-build-isolation --ignore-requires-python -e . || exit 1
        [ -d "$SMALL_CHECKPOINT" ] || k3c init-checkpoint --preset k3-small "$SMALL_CHECKPOINT" || exit 1
    else
        pip install -q -e . || exit 1
    fi
}

# validate NAME [N]: the prepared bundle, or one compiled now (for N GPUs: k3-tiny-xN); results as
# JSON in $LOGS
validate() {
    local name=$1 n=${2:-1} start=$SECONDS
    local preset=${name%-x*}
    if [ -d "$GPU/$name-cuda" ]; then
        timeout 150 k3c validate "$GPU/$name-cuda" --json "$LOGS/$name.json" >"$LOGS/$name.log" 2>&1
    elif [ "$n" = 1 ]; then
        timeout 240 k3c validate --preset "$name" --target cuda -o "$LOGS/$name-cuda" --json "$LOGS/$name.json" \
            >"$LOGS/$name.log" 2>&1
    else
        { timeout 400 k3c compile --preset "$preset" --target cuda --devices "$n" -o "$LOGS/$name-cuda" &&
            timeout 150 k3c validate "$LOGS/$name-cuda" --json "$LOGS/$name.json"; } >"$LOGS/$name.log" 2>&1
    fi
    echo "$name $? $((SECONDS - start))" >>"$LOGS/status"
}

check() {
    install
    LOGS=$(mktemp -d)
    k3c targets
    validate k3-tiny
    [ "$DEVICES" = 1 ] || validate "k3-tiny-x$DEVICES" "$DEVICES"
    validate k3-small
    small=$([ -d "$GPU/k3-small-cuda" ] && echo "$GPU/k3-small-cuda" || echo "$LOGS/k3-small-cuda")
    timeout 60 k3c run "$small" --prompt-ids 1,2,3,4,5,6,7,8 -n 16 >"$LOGS/run.log" 2>&1
    echo "run $? 0" >>"$LOGS/status"
    python3 - "$LOGS" <<'EOF'
import json, sys
from pathlib import Path
from rich.console import Console
from rich.table import Table

logs = Path(sys.argv[1])
table = Table(title="k3c on CUDA")
for column in ("check", "result", "max abs error", "top-1", "detail", "wall s"):
    table.add_column(column)
failed = False
for line in (logs / "status").read_text().splitlines():
    name, code, wall = line.split()
    log = (logs / f"{name}.log").read_text().strip().splitlines() or ["(no output)"]
    failed |= code != "0"
    result = "PASS" if code == "0" else ("TIMEOUT" if code == "124" else "FAIL")
    if name == "run":
        table.add_row("k3-small decode, 16 tokens", result, "", "", log[-1], "")
    elif (logs / f"{name}.json").is_file():
        steps = json.loads((logs / f"{name}.json").read_text())["steps"]
        table.add_row(f"{name} validate", result, f"{max(s['max_abs'] for s in steps):.2e}",
                      f"{min(s['top1'] for s in steps):.3f}", f"{len(steps)} steps", wall)
    else:
        table.add_row(f"{name} validate", result, "", "", log[-1], wall)
Console(width=160).print(table)
sys.exit(1 if failed else 0)
EOF
}

case "${1:-check}" in
    prepare) prepare ;;
    check) check ;;
    *) echo "usage: scripts/gpu_check.sh [prepare|check] [N]" >&2; exit 2 ;;
esac
