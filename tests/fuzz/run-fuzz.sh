#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Runs the libFuzzer target for a bounded time, as CI does (./dev.sh test), and
# says what it did; on a crash, says how to reproduce it. docs/fuzzing.md.
#
#   tests/fuzz/run-fuzz.sh BUILD_DIR [libFuzzer options...]
#
# BUILD_DIR was configured with CC=clang and -Dfuzz=true. Environment:
#   FUZZ_SECONDS  wall-clock limit (default 60)
#   FUZZ_RUNS     limit on executions (default 2000000)
# New inputs that reach new code go to BUILD_DIR/fuzz-corpus (kept between runs),
# crashes to BUILD_DIR/fuzz-artifacts/, the whole log to BUILD_DIR/fuzz.log.
set -euo pipefail

build=${1:?usage: run-fuzz.sh BUILD_DIR [libFuzzer options...]}
shift
src=$(cd "$(dirname "$0")" && pwd)
fuzzer=$build/tests/fuzz/fuzz-daemon
seconds=${FUZZ_SECONDS:-60}
runs=${FUZZ_RUNS:-2000000}
work=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
log=$build/fuzz.log

if [ ! -x "$fuzzer" ]; then
        echo "run-fuzz.sh: $fuzzer is not built: CC=clang meson setup $build -Dfuzz=true ...; ninja -C $build fuzz" >&2
        exit 2
fi
mkdir -p "$work" "$artifacts"

# Symbolized stacks in reports (Debian's llvm-14 names it llvm-symbolizer-14).
for s in llvm-symbolizer llvm-symbolizer-14; do
        if command -v "$s" >/dev/null; then
                export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-$(command -v "$s")}
                break
        fi
done
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# -max_len: room for a message over the daemon's 64 KiB limit. -timeout: one input that takes this long is
# a hang (the target itself fails on an event loop that never settles). The seed corpus is read, not written.
options=(-max_total_time="$seconds" -runs="$runs" -max_len=70000 -timeout=30 -rss_limit_mb=4096
         -dict="$src/varlink.dict" -artifact_prefix="$artifacts/" -print_final_stats=1 "$@")
echo "fuzz-daemon: up to $seconds s and $runs executions, from $(ls "$src/corpus" | wc -l) seeds and $(ls "$work" | wc -l) saved inputs"
start=$(date +%s)
status=0
"$fuzzer" "${options[@]}" "$work" "$src/corpus" >"$log" 2>&1 || status=$?
elapsed=$(($(date +%s) - start))

final_stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
last=$(grep -a -E '^#[0-9]+[[:space:]]+(INITED|pulse|NEW|REDUCE|DONE)' "$log" | tail -1 || true)
cov=$(sed -n 's/.* cov: \([0-9]*\) .*/\1/p' <<<"$last")
ft=$(sed -n 's/.* ft: \([0-9]*\) .*/\1/p' <<<"$last")
corp=$(sed -n 's/.* corp: \([^ ]*\) .*/\1/p' <<<"$last")
echo "fuzz-daemon: $(final_stat number_of_executed_units) executions in ${elapsed} s ($(final_stat average_exec_per_sec) exec/s)," \
     "coverage: ${cov:-?} edges, ${ft:-?} features, corpus ${corp%%/*} inputs (${corp#*/}), peak RSS $(final_stat peak_rss_mb) MB"

if [ "$status" -ne 0 ]; then
        echo "fuzz-daemon FAILED (exit status $status); the end of $log:"
        tail -n 80 "$log"
        crash=$(ls -t "$artifacts" 2>/dev/null | head -1)
        if [ -n "$crash" ]; then
                echo
                echo "The input ($artifacts/$crash), base64 (base64 -d gives the file back):"
                base64 "$artifacts/$crash" | head -c 20000
                echo
                echo "Reproduce:  $fuzzer $artifacts/$crash"
                echo "See what it sends and gets:  FUZZ_DAEMON_TRACE=1 $fuzzer $artifacts/$crash"
                echo "Without clang:  <gcc build>/tests/fuzz/fuzz-daemon $artifacts/$crash   (docs/fuzzing.md)"
        fi
        exit 1
fi
