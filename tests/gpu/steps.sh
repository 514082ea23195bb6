# SPDX-License-Identifier: MIT
# Sourced by tests/gpu/run.sh and several.sh with their arguments (BUILD_DIR [OUT_DIR]): the build, the
# log folder, libraries from .carry/lib, the real driver; their steps, what failed, and the summary.
set -uo pipefail
build=${1:?usage: $0 BUILD_DIR [OUT_DIR]}
out=${2:-${OUT:-/tmp}}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
sim="$PWD/$build/tests/simcuda/libcuda.so.1"         # the simulated driver, for the steps that compare
unset VMMBROKER_LIBCUDA
status=0
results=()
current=""
step() { current="$*"; printf '\n=== %s\n' "$*"; }
# Records that the current step failed (and the script with it); the summary lists them.
failed() { status=1; results+=("FAILED  $current${1:+ ($1)}"); }
# The last step: every failed (or skipped) step, or that every step passed.
summary() {
        step "${1:-summary}"
        if [ ${#results[@]} -eq 0 ]; then
                echo "every step passed"
        else
                printf '%s\n' "${results[@]}"
        fi
}
