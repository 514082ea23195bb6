#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# What a machine of several GPUs proves for this tree (issue 18), in one command:
#
#   tests/gpu/several.sh BUILD_DIR [OUT_DIR]
#
# 1. the driver conformance suite on each device against the real driver, and once on as many simulated
#    devices: its "pair" checks (peer access between the device and the next one) run where there are two,
#    and the observed lines of the real and simulated runs are diffed;
# 2. test-devices against the real driver: its "pair" tests hold a lease on each device, spread leases by
#    the default placement, and write a lease of one device through another (vmmb_lease_grant_access()) and
#    read it back (its tests of four simulated devices say they did not run);
# 3. bench-broker and bench-park on each device: CUDA_VISIBLE_DEVICES=N makes device N the only one the
#    daemon and the benchmark see.
#
# tests/gpu/run.sh calls it when nvidia-smi lists two GPUs or more. BUILD_DIR and libraries as for run.sh.
# Exit status 0 when every step passed; 2 when the machine has fewer than two GPUs (nothing run).
. "$(dirname "$0")/steps.sh"
unset CUDA_VISIBLE_DEVICES
export VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd" VMMCTL="$PWD/$build/client/vmmctl"

n=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [ "$n" -lt 2 ]; then
        echo "several.sh: this machine has $n GPU(s); the checks of several GPUs need two or more" >&2
        exit 2
fi

step "GPUs and how they reach each other"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -$((n + 1))

for d in $(seq 0 $((n - 1))); do
        step "conformance suite on device $d, real driver"
        VMMB_CONFORMANCE_DEVICE=$d "$build/tests/conformance/vmmb-conformance" >"$out/conformance-gpu$d.log" 2>&1 ||
                failed
        grep -E '%:|:F:|:E:|^info: device .* can access' "$out/conformance-gpu$d.log"
done
step "conformance suite on $n simulated devices (to compare the observed lines)"
VMMBROKER_LIBCUDA=$sim SIMCUDA_DEVICES=$n "$build/tests/conformance/vmmb-conformance" >"$out/conformance-sim$n.log" \
        2>&1 || failed
grep -E '%:|:F:|:E:' "$out/conformance-sim$n.log"
step "observed lines that differ (device 0 < > simulated), the pair's first"
diff <(grep '^observed:' "$out/conformance-gpu0.log" | sort) <(grep '^observed:' "$out/conformance-sim$n.log" | sort) &&
        echo "none"
grep -E '^observed: .*(peer|pair)' "$out/conformance-gpu0.log" | sort -u

step "vmmctl status of a daemon serving every device"
"$build/docs/examples/with-daemon" "$build/client/vmmctl" status 2>&1 | tee "$out/vmmctl-status.log" || failed

step "test-devices against the real driver: a lease on each device, placement, one device writing another's lease"
"$build/tests/integration/test-devices" >"$out/test-devices.log" 2>&1 || failed
grep -E '%:|:F:|:E:|not run|^info' "$out/test-devices.log"

for d in $(seq 0 $((n - 1))); do
        step "broker benchmark on device $d alone (CUDA_VISIBLE_DEVICES=$d)"
        CUDA_VISIBLE_DEVICES=$d "$build/tests/bench/bench-broker" 20 >"$out/bench-broker-gpu$d.log" 2>&1 || failed
        grep -E '^(gpu:|request vs floor|free vs unmap|round trips)' "$out/bench-broker-gpu$d.log"
        step "park benchmark on device $d alone (CUDA_VISIBLE_DEVICES=$d)"
        CUDA_VISIBLE_DEVICES=$d "$build/tests/bench/bench-park" 10 1024 >"$out/bench-park-gpu$d.log" 2>&1 || failed
        grep -E '^(gpu:|floor|park|unpark|target)' "$out/bench-park-gpu$d.log"
done

summary "summary (several GPUs)"
exit $status
