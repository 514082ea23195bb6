#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Set-up and everyday commands for vmmbroker on Debian 12. Each command first
# installs the Debian packages it needs when they are missing.
#
#   ./dev.sh run     build, then run the broker in the foreground on a socket of
#                    your own: on the machine's GPU, or on the simulated device
#                    when there is no driver (it says which); Ctrl-C stops it.
#                    You are its administrator (vmmctl list --all, vmmctl top)
#                    and may lease its whole pool: it reads build/dev/vmmbroker.conf,
#                    which it writes (AdminGroup= your group, MaxBytes=100% for you)
#   ./dev.sh test    build and run every test, then again under
#                    AddressSanitizer + UndefinedBehaviorSanitizer, then the
#                    suites with threads (unit, proto, client, integration,
#                    restart, supervisor) under ThreadSanitizer, then fuzz
#                    the daemon for $FUZZ_SECONDS (60) s with libFuzzer (clang)
#   ./dev.sh bench   build, then run the benchmarks (GPU or simulated device)
#   ./dev.sh help    this text
#
# Build folders: build/ (plain), build-sanitize/ (ASan + UBSan), build-tsan/
# (ThreadSanitizer) and build-fuzz/ (clang, libFuzzer + ASan + UBSan). Extra
# arguments after `test` go to `meson test` (e.g. ./dev.sh test pool) and skip
# ThreadSanitizer and the fuzzing; after `run`, to vmmbrokerd (e.g. ./dev.sh
# run --capacity 50%); after `bench`, to bench-pool.
set -euo pipefail
cd "$(dirname "$0")"

# systemd: systemd-analyze and systemd-socket-activate for the unit and activation tests;
# systemd-container: systemd-nspawn, which boots systemd in a container for tests/systemd/boot-test.sh;
# python3: the Python package's tests (tests/python), with Debian's /usr/bin/python3;
# python3-prometheus-client: the OpenMetrics parser that checks vmmctl metrics (tests/integration);
# groff-base: the man page check; clang and libclang-rt-14-dev (libFuzzer and the sanitizers' runtimes, only
# recommended by clang) for the fuzz target, llvm-14 for llvm-symbolizer in its reports.
PACKAGES=(meson ninja-build gcc pkg-config libjson-c-dev libsystemd-dev check varlink-go systemd systemd-container python3
          python3-prometheus-client groff-base clang libclang-rt-14-dev llvm-14)

say() { printf '==> %s\n' "$*" >&2; }

install_packages() {
        local missing=()
        for p in "${PACKAGES[@]}"; do
                dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
        done
        [ ${#missing[@]} -eq 0 ] && return 0
        say "installing ${missing[*]}"
        local sudo=()
        [ "$(id -u)" -eq 0 ] || sudo=(sudo)
        "${sudo[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

check_cuda_headers() {
        local dir
        for dir in ${CUDA_PATH:+"$CUDA_PATH/include"} /usr/local/cuda/include; do
                [ -f "$dir/cuda.h" ] && return 0
        done
        say "cuda.h not found in \$CUDA_PATH/include or /usr/local/cuda/include."
        say "Install the CUDA toolkit headers (NVIDIA's CUDA 12 or 13 toolkit), or set CUDA_PATH to the toolkit."
        exit 1
}

# setup DIR [meson options...]: configure DIR once, then build it.
build() {
        local dir=$1
        shift
        if [ ! -f "$dir/build.ninja" ]; then
                meson setup "$dir" "$@"
        fi
        ninja -C "$dir"
}

# Prints which driver the broker will use, and exports VMMBROKER_LIBCUDA for the simulated one.
pick_driver() {
        if [ -n "${VMMBROKER_LIBCUDA:-}" ]; then
                say "driver: $VMMBROKER_LIBCUDA (from VMMBROKER_LIBCUDA)"
        elif ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && [ -e /dev/nvidiactl ]; then
                say "driver: the NVIDIA driver's libcuda.so.1 (real GPU)"
        else
                export VMMBROKER_LIBCUDA="$PWD/build/tests/simcuda/libcuda.so.1"
                say "driver: no NVIDIA driver here, using the SIMULATED device ($VMMBROKER_LIBCUDA)"
        fi
}

# Prints "OK FAILED SKIPPED" counts from a build folder's meson test log.
counts() {
        python3 - "$1/meson-logs/testlog.json" <<'EOF'
import json, sys
ok = fail = skip = 0
try:
    for line in open(sys.argv[1]):
        r = json.loads(line)["result"]
        if r in ("OK", "EXPECTEDFAIL"): ok += 1
        elif r == "SKIP": skip += 1
        else: fail += 1
except OSError:
    fail = 1
print(ok, fail, skip)
EOF
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
run)
        install_packages
        check_cuda_headers
        build build
        pick_driver
        sock="${XDG_RUNTIME_DIR:-/tmp}/vmmbroker-$(id -u)/io.vmmbroker"
        # A development broker: whoever starts it administers it and may lease its whole pool.
        mkdir -p build/dev
        printf '%s\n' "# Written by ./dev.sh run for a development broker started by $(id -un): the members of" \
                "# its group are administrators, and it may lease the whole pool (vmmbroker.conf(5))." \
                "[Broker]" "AdminGroup=$(id -gn)" "" "[User:$(id -un)]" "MaxBytes=100%" >build/dev/vmmbroker.conf
        say "self-check: build/daemon/vmmbrokerd --config build/dev/vmmbroker.conf --check"
        build/daemon/vmmbrokerd --config build/dev/vmmbroker.conf --check "$@"
        cat >&2 <<EOF
==> starting the broker on $sock (Ctrl-C stops it). From another shell:
      export VMMBROKER_SOCKET=$sock${VMMBROKER_LIBCUDA:+ VMMBROKER_LIBCUDA=$VMMBROKER_LIBCUDA}
      build/docs/examples/lease-pattern 256M            # lease, write, verify, free
      docs/examples/run-pair.sh build/docs/examples/lease-pattern 64M 4
      build/client/vmmctl top                           # the live view (q quits)
==> configuration: build/dev/vmmbroker.conf (you administer this broker; MaxBytes=100% for you)
EOF
        exec build/daemon/vmmbrokerd --config build/dev/vmmbroker.conf --socket "$sock" "$@"
        ;;
test)
        install_packages
        check_cuda_headers
        status=0
        say "build/: plain build"
        build build
        meson test -C build --print-errorlogs "$@" || status=1
        read -r ok1 fail1 skip1 < <(counts build)
        say "build-sanitize/: AddressSanitizer + UndefinedBehaviorSanitizer"
        build build-sanitize -Db_sanitize=address,undefined -Db_lundef=false
        meson test -C build-sanitize --print-errorlogs "$@" || status=1
        read -r ok2 fail2 skip2 < <(counts build-sanitize)
        ok3=0 fail3=0 fuzzing="" ok4=0 fail4=0 tsan=""
        if [ $# -eq 0 ]; then
                # The suites whose code runs threads (the library's watch, the simulated driver's stream
                # callbacks, the tests' own); not python (the interpreter is not instrumented), nor the
                # soak (its seqlock is across processes: tests/soak/meson.build), docs, systemd, examples.
                say "build-tsan/: ThreadSanitizer (suites unit, proto, client, integration, restart, supervisor)"
                build build-tsan -Db_sanitize=thread
                TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/tests/tsan.supp" meson test -C build-tsan \
                        --print-errorlogs --suite unit --suite proto --suite client --suite integration \
                        --suite restart --suite supervisor || status=1
                read -r ok4 fail4 _ < <(counts build-tsan)
                tsan="; thread sanitizer: $ok4 passed, $fail4 failed"
                say "build-fuzz/: libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer (clang), ${FUZZ_SECONDS:-60} s"
                if [ ! -f build-fuzz/build.ninja ]; then
                        CC=clang meson setup build-fuzz -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false
                fi
                ninja -C build-fuzz     # the whole tree: with clang too, every warning is an error (40 s more)
                if tests/fuzz/run-fuzz.sh build-fuzz; then ok3=1; else fail3=1 status=1; fi
                fuzzing="; fuzzing: $ok3 passed, $fail3 failed"
        fi
        echo "plain build: $ok1 passed, $fail1 failed; sanitizers: $ok2 passed, $fail2 failed$tsan$fuzzing"
        echo "$((ok1 + ok2 + ok3 + ok4)) passed, $((fail1 + fail2 + fail3 + fail4)) failed, $((skip1 + skip2)) skipped"
        exit $status
        ;;
bench)
        install_packages
        check_cuda_headers
        build build
        pick_driver
        exec build/tests/bench/bench-pool "$@"
        ;;
*)
        # the comment at the top, whole: from line 3 to the first line that is not a comment
        sed -n '4,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
        [ -z "$cmd" ] || [ "$cmd" = help ] || [ "$cmd" = --help ] || exit 2
        ;;
esac
