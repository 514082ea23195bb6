#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# What a GPU run proves for this tree, in one command on a machine with the
# NVIDIA driver (README.md, "Other commands"): the driver conformance suite
# against the real driver, the daemon's self-check, and the pool benchmark;
# then the same benchmark on the simulated device for comparison. Later, the
# broker benchmarks: bench-broker, and bench-trace on the recorded training
# trace (recorded first with PyTorch while the tree has none). On a machine of
# two GPUs or more, last, tests/gpu/several.sh (issue 18's runs).
#
#   tests/gpu/run.sh BUILD_DIR [OUT_DIR]
#
# BUILD_DIR is a build folder made on the development machine (the GPU
# machine's Meson differs, so this script runs the programs directly).
# Libraries missing on the GPU machine (libsubunit, libjson-c) are looked for
# in .carry/lib. Logs go to OUT_DIR (default: $OUT, else /tmp).
. "$(dirname "$0")/steps.sh"

step "GPU"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
# The steps up to several.sh are one GPU's: on a machine of several, the first (or the one named), so that
# their numbers compare across machines. several.sh sees them all.
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
# Each Check test has the time `meson test` gives it (tests/meson.build), not Check's default of 4 s: on the
# GPU a test's processes each start a CUDA context.
export CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-60}

step "conformance suite, real driver"
"$build/tests/conformance/vmmb-conformance" >"$out/conformance-gpu.log" 2>&1 || failed
grep -E '^observed:|%:|Checks' "$out/conformance-gpu.log"
step "conformance suite, simulated device (to compare the observed lines)"
VMMBROKER_LIBCUDA=$sim "$build/tests/conformance/vmmb-conformance" >"$out/conformance-sim.log" 2>&1 || failed
grep -E '%:|Checks' "$out/conformance-sim.log"
step "observed error codes that differ (real < > simulated)"
diff <(grep '^observed:' "$out/conformance-gpu.log" | sort) <(grep '^observed:' "$out/conformance-sim.log" | sort) &&
        echo "none"

step "vmmbrokerd --check, real driver"
"$build/daemon/vmmbrokerd" --check 2>&1 | tee "$out/check.log" || failed

step "pool benchmark, simulated device"
VMMBROKER_LIBCUDA=$sim "$build/tests/bench/bench-pool" 3 2>&1 | tee "$out/bench-sim.log" || failed
step "driver costs, real driver"
"$build/tests/bench/bench-driver" 20 2>&1 | tee "$out/bench-driver.log" || failed
step "pool benchmark, real driver"
"$build/tests/bench/bench-pool" 20 2>&1 | tee "$out/bench-gpu.log" || failed

export VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" VMMCTL="$PWD/$build/client/vmmctl"
for t in tests/integration/test-daemon tests/integration/test-share tests/integration/test-vmmctl \
         tests/integration/test-limits tests/integration/test-fairness tests/integration/test-tenant \
         tests/integration/test-wait tests/integration/test-reclaim tests/integration/test-keep tests/integration/test-park \
         tests/client/test-client \
         tests/client/test-client-reclaim tests/client/test-keep; do
        [ -x "$build/$t" ] || continue
        step "$t against the real driver (the daemon and its clients on the GPU)"
        "$build/$t" >"$out/$(basename "$t").log" 2>&1 || failed
        grep -E '%:|:F:|:E:' "$out/$(basename "$t").log"
done

if [ -x "$build/docs/examples/lease-pattern" ]; then
        step "4 lease-pattern processes at once, 1 GiB each, through one daemon"
        "$build/docs/examples/with-daemon" sh docs/examples/run-pair.sh "$build/docs/examples/lease-pattern" 1G 4 ||
                status=1
fi

if [ -x "$build/client/vmmctl" ]; then
        step "vmmctl status and list --all while 3 lease-pattern processes hold 1 GiB each"
        "$build/docs/examples/with-daemon" bash docs/examples/show-leases.sh "$build/docs/examples/lease-pattern" \
                "$build/client/vmmctl" 1G 3 || failed
fi

if [ -x "$build/docs/examples/publish-pattern" ]; then
        step "publish-pattern 1 GiB and exits; then 3 attach-pattern processes attach it by name"
        "$build/docs/examples/with-daemon" bash docs/examples/share-pair.sh "$build/docs/examples/publish-pattern" \
                "$build/docs/examples/attach-pattern" 1G 3 "$build/client/vmmctl" || failed
fi

# A PyTorch program of tests/gpu/python against this build's daemon: its log, and its last N lines shown.
torch_program() {
        local script=$1 log=$2 lines=$3
        if python3 -c 'import torch' 2>/dev/null; then
                VMMBROKER_BUILD=$build VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" \
                        python3 "tests/gpu/python/$script" >"$out/$log" 2>&1 || failed
                tail -"$lines" "$out/$log"
        else
                echo "no PyTorch here: not run"
                results+=("SKIPPED $current (no PyTorch)")
        fi
}

step "a model in a broker-backed MemPool put to sleep and woken: the same logits (tests/gpu/python/test_sleep_wake.py)"
torch_program test_sleep_wake.py test-sleep-wake.log 8

step "a KV-cache-like ReclaimableBuffer given back to a waiting process, and one that refuses (tests/gpu/python/test_reclaimable_buffer.py)"
torch_program test_reclaimable_buffer.py test-reclaimable-buffer.log 4

step "a 16 GiB kept lease (at most a quarter of the device) asked back while another process calls Status: it is answered meanwhile (tests/gpu/python/kept_stall.py)"
VMMBROKER_BUILD=$build VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" \
        python3 tests/gpu/python/kept_stall.py 10 >"$out/kept-stall.log" 2>&1 || failed
tail -14 "$out/kept-stall.log"

step "parks and unparks of 8 GiB (host memory pinned for the first) while another process calls Status: it is answered meanwhile (tests/gpu/python/park_stall.py)"
VMMBROKER_BUILD=$build VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" \
        python3 tests/gpu/python/park_stall.py 8 >"$out/park-stall.log" 2>&1 || failed
tail -16 "$out/park-stall.log"

step "a 100 MiB first park 0.2 s in while another process's first park of 8 GiB pins: it does not wait for all of it (tests/gpu/python/park_turns.py)"
VMMBROKER_BUILD=$build VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" \
        python3 tests/gpu/python/park_turns.py 8 3 >"$out/park-turns.log" 2>&1 || failed
tail -9 "$out/park-turns.log"

step "a 100 MiB park 20 ms into another process's park of 8 GiB, host memory cached: it does not wait for the whole copy (tests/gpu/python/copy_turns.py)"
VMMBROKER_BUILD=$build VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" \
        python3 tests/gpu/python/copy_turns.py 8 3 >"$out/copy-turns.log" 2>&1 || failed
tail -9 "$out/copy-turns.log"

if [ "$(id -u)" -eq 0 ] && [ -x "$build/docs/examples/lease-pattern" ]; then
        step "tenant isolation: user A's canary, then user B (uid 65534) leases the same amount"
        bash tests/gpu/canary.sh "$build" 1G 65534 || failed
fi

if [ -x "$build/tests/restart/test-restart" ]; then
        step "restarts without loss: 20 restarts (half SIGKILL) with clients holding canaries; READY with 1000 leases; an 8G HostReserve= kept"
        CK_DEFAULT_TIMEOUT=500 VMMB_RESTARTS=20 VMMB_RESTART_LEASES=1000 VMMB_RESTART_RESERVE=8G \
                "$build/tests/restart/test-restart" \
                >"$out/test-restart.log" 2>&1 || failed
        grep -E '%:|:F:|:E:|^restart:' "$out/test-restart.log"
        "$build/tests/client/test-reconnect" >"$out/test-reconnect.log" 2>&1 || failed
        grep -E '%:|:F:|:E:' "$out/test-reconnect.log"
fi

if [ -x "$build/tests/restart/test-store-faults" ]; then
        step "the lease table's store failing and crashing at each step, on the real driver"
        CK_DEFAULT_TIMEOUT=280 "$build/tests/restart/test-store-faults" >"$out/test-store-faults.log" 2>&1 || failed
        grep -E '%:|:F:|:E:|^store' "$out/test-store-faults.log"
fi

if [ -x "$build/tests/bench/bench-broker" ]; then
        step "broker benchmark, real driver (request and free against the driver floor for the daemon's slabs)"
        "$build/tests/bench/bench-broker" 20 2>&1 | tee "$out/bench-broker.log" || failed
fi

if [ -x "$build/tests/bench/bench-park" ]; then
        step "park benchmark, real driver (1 GiB parked and unparked against the daemon's copy made in-process)"
        "$build/tests/bench/bench-park" 10 1024 2>&1 | tee "$out/bench-park.log" || failed
fi

if [ -x "$build/tests/bench/bench-trace" ]; then
        # The trace kept in the tree; until there is one, record it here (PyTorch and transformers needed)
        # and say so: it is to be committed as tests/bench/traces/gpt2-train-segments.txt.
        trace=tests/bench/traces/gpt2-train-segments.txt
        if [ ! -f "$trace" ] && python3 -c 'import torch, transformers' 2>/dev/null; then
                step "recording the segments of a GPT-2-shaped training run (PyTorch's allocator, no broker)"
                trace=$out/gpt2-train-segments.txt
                python3 tests/gpu/python/record_segments.py "$trace" 2>&1 | tail -3 || failed
                echo "not in the tree yet: commit $trace as tests/bench/traces/gpt2-train-segments.txt"
        fi
        step "workload trace benchmark, real driver (bench-trace $trace)"
        if [ -f "$trace" ]; then
                "$build/tests/bench/bench-trace" "$trace" 5 2>&1 | tee "$out/bench-trace.log" || failed
        else
                echo "no trace: $trace is not in the tree and PyTorch with transformers is not here to record it"
                results+=("SKIPPED $current (no trace to replay)")
        fi
fi

if [ -x "$build/tests/bench/bench-scale" ] && [ "${VMMB_GPU_SCALE:-1}" = 1 ]; then
        step "scaling targets on the simulated device, on this machine's cores (bench-scale, bench-tenant, bench-store)"
        VMMBROKER_LIBCUDA=$sim "$build/tests/bench/bench-scale" >"$out/bench-scale.log" 2>&1 || failed
        sed -n '/target    verdict/,$p' "$out/bench-scale.log"
        VMMBROKER_LIBCUDA=$sim "$build/tests/bench/bench-tenant" >"$out/bench-tenant.log" 2>&1 || failed
        grep -E 'idle|under flood|target' "$out/bench-tenant.log"
        "$build/tests/bench/bench-store" >"$out/bench-store.log" 2>&1 || failed
        tail -12 "$out/bench-store.log"
fi

if [ "$gpus" -ge 2 ]; then
        step "several GPUs: tests/gpu/several.sh (its own steps and summary follow)"
        env -u CUDA_VISIBLE_DEVICES bash tests/gpu/several.sh "$build" "$out/several" || failed
fi

summary
exit $status
