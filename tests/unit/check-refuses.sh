#!/bin/sh
# SPDX-License-Identifier: MIT
# `vmmbrokerd --check` on a device without VMM must exit 1 (not crash) and say why.
# Usage: check-refuses.sh VMMBROKERD [OPTIONS...]   (with SIMCUDA_NO_VMM=1 in the environment)
out=$("$@" --check 2>&1)
status=$?
echo "$out"
[ "$status" -eq 1 ] || { echo "expected exit status 1, got $status" >&2; exit 1; }
echo "$out" | grep -q "does not support virtual memory management" ||
        { echo "the message does not name the missing VMM support" >&2; exit 1; }
