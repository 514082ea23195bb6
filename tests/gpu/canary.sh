#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Tenant isolation on a real GPU: user A (root) leases SIZE, fills it with its
# own words (the canary) and exits; then user B (another uid) leases the same
# amount and must read zero in every word before writing. As a control, A
# leases again: its own scrubbed slabs come back from the cache, zeroed too.
# Runs its own daemon (with-daemon), whose socket B is let into.
#
#   tests/gpu/canary.sh BUILD_DIR [SIZE] [UID_B]
#
# Must run as root (to run B as another uid). Exit status 0 when B never saw
# the canary and every lease read zero.
set -uo pipefail
build=${1:?usage: tests/gpu/canary.sh BUILD_DIR [SIZE] [UID_B]}
size=${2:-1G}
uid_b=${3:-65534}
prog="$PWD/$build/docs/examples/lease-pattern"
export VMMBROKER_DAEMON="$PWD/$build/daemon/vmmbrokerd"

[ "$(id -u)" -eq 0 ] || { echo "canary: run as root, to run user B as uid $uid_b" >&2; exit 1; }
# The daemon's socket lives in a private 0700 directory; B needs to reach it.
"$PWD/$build/docs/examples/with-daemon" bash -c '
        chmod 0711 "$(dirname "$VMMBROKER_SOCKET")" && chmod 0666 "$VMMBROKER_SOCKET" || exit 1
        status=0
        echo "=== user A (uid $(id -u)) writes its canary into $2 and exits"
        "$1" "$2" || status=1
        echo "=== user B (uid $3) leases $2: it must read zero before writing"
        setpriv --reuid="$3" --regid="$3" --clear-groups "$1" --zero "$2" || status=1
        echo "=== user A again: its own slabs come back from the cache, zeroed"
        "$1" --zero "$2" || status=1
        exit $status' canary "$prog" "$size" "$uid_b"
