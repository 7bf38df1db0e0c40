#!/usr/bin/env bash
# NVIDIA GPU check: k3-tiny and k3-small validated against PyTorch on CUDA, then decode timed, and
# k3-tiny validated on the GPU's Vulkan driver where one is found; one table at the end.
#
#   scripts/gpu_check.sh prepare   here, in the project's venv: compile into out/gpu the k3-tiny
#                                  bundles for cuda and vulkan:ampere (NVIDIA's profile) and k3-small's
#                                  cuda module (--no-weights), and fetch the wheels the GPU machine lacks
#   scripts/gpu_check.sh           on the NVIDIA machine: a venv, the project, the checks (< 5 minutes);
#                                  logs and JSON in $LOGS (default: a new temporary directory)
#   scripts/gpu_check.sh prepare N / check N
#                                  also k3-tiny compiled for N GPUs (k3c compile --devices N: the routed
#                                  experts split over them) and validated on N GPUs
#
# The lent GPU machine has Python 3.12 with torch but no network, and a call carries at most 64 MiB:
# iree-base-compiler's wheel (84 MB) and k3-small's weights (400 MB) do not travel. So the modules are
# compiled here and out/gpu is carried (running a bundle needs iree-base-runtime alone), and the check
# writes k3-small's seeded checkpoint there and attaches it to the carried module (k3c attach packs
# the weights and computes the reference outputs). Without out/gpu (a machine with network), the check
# installs everything and compiles the bundles itself.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1  # stdout and stderr land in the logs in the order printed
GPU=out/gpu
# the runtime, and a setuptools that reads pyproject.toml's license fields (the editable install
# builds without isolation there)
WHEELS=(iree-base-runtime==3.13.0 "setuptools>=77")
DEVICES=${2:-1}
[[ "$DEVICES" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: N must be a positive device count, got $DEVICES" >&2; exit 2; }

prepare() {
    set -e
    k3c compile --preset k3-tiny --target cuda -o "$GPU/k3-tiny-cuda" --force
    k3c compile --preset k3-tiny --target vulkan:ampere -o "$GPU/k3-tiny-vulkan" --force
    [ "$DEVICES" = 1 ] ||
        k3c compile --preset k3-tiny --target cuda --devices "$DEVICES" -o "$GPU/k3-tiny-x$DEVICES-cuda" --force
    k3c compile --preset k3-small --no-weights --target cuda -o "$GPU/k3-small-module" --force
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$GPU/wheels" "${WHEELS[@]}"
    du -sh "$GPU"
    echo "prepared: run scripts/gpu_check.sh on the GPU machine with out/gpu carried"
}

purelib() { python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

install() {
    local outer; outer=$(purelib)
    python3 -m venv --system-site-packages /tmp/k3c-venv && . /tmp/k3c-venv/bin/activate || exit 1
    # python3 there is itself a venv's, whose packages (torch) are not the system's: keep them in view
    echo "$outer" >"$(purelib)/outer.pth"
    if [ -d "$GPU/wheels" ]; then
        pip install -q --no-index --no-deps "$GPU"/wheels/*.whl &&
            pip install -q --no-deps --no-build-isolation --ignore-requires-python -e . || exit 1
    else
        pip install -q -e . || exit 1
    fi
}

# validate NAME [N]: the prepared bundle $GPU/NAME-cuda, k3-small attached to its prepared module, or
# one compiled now (for N GPUs: k3-tiny-xN); results as JSON in $LOGS
validate() {
    local name=$1 n=${2:-1} start=$SECONDS
    local preset=${name%-x*} bundle=$GPU/$1-cuda
    if [ ! -d "$bundle" ] && [ -d "$GPU/$name-module" ]; then
        bundle=$LOGS/$name-cuda
        { timeout 120 k3c init-checkpoint --preset "$name" "$LOGS/$name-checkpoint" &&
            timeout 120 k3c attach "$GPU/$name-module" --checkpoint "$LOGS/$name-checkpoint" -o "$bundle"; } \
            >"$LOGS/$name.log" 2>&1 || { echo "$name $? $((SECONDS - start))" >>"$LOGS/status"; return; }
    fi
    if [ -d "$bundle" ]; then
        timeout 150 k3c validate "$bundle" --json "$LOGS/$name.json" >>"$LOGS/$name.log" 2>&1
    elif [ "$n" = 1 ]; then
        bundle=$LOGS/$name-cuda
        timeout 240 k3c validate --preset "$name" --target cuda -o "$bundle" --json "$LOGS/$name.json" \
            >"$LOGS/$name.log" 2>&1
    else
        bundle=$LOGS/$name-cuda
        { timeout 400 k3c compile --preset "$preset" --target cuda --devices "$n" -o "$bundle" &&
            timeout 150 k3c validate "$bundle" --json "$LOGS/$name.json"; } >"$LOGS/$name.log" 2>&1
    fi
    echo "$name $? $((SECONDS - start))" >>"$LOGS/status"
}

check() {
    install
    LOGS=${LOGS:-$(mktemp -d)} && mkdir -p "$LOGS" && echo "logs: $LOGS"
    k3c targets
    validate k3-tiny
    [ "$DEVICES" = 1 ] || validate "k3-tiny-x$DEVICES" "$DEVICES"
    validate k3-small
    if [ -d "$GPU/k3-tiny-vulkan" ]; then
        start=$SECONDS
        timeout 150 k3c validate "$GPU/k3-tiny-vulkan" --json "$LOGS/k3-tiny-vulkan.json" >"$LOGS/k3-tiny-vulkan.log" 2>&1
        echo "k3-tiny-vulkan $? $((SECONDS - start))" >>"$LOGS/status"
    fi
    timeout 60 k3c run "$LOGS/k3-small-cuda" --prompt-ids 1,2,3,4,5,6,7,8 -n 16 >"$LOGS/run.log" 2>&1
    echo "run $? 0" >>"$LOGS/status"
    python3 - "$LOGS" <<'EOF'
import json, sys
from pathlib import Path
from rich.console import Console
from rich.table import Table

logs = Path(sys.argv[1])
table = Table(title="k3c on an NVIDIA GPU")
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
