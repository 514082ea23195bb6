#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# callgrind-requests.sh: the instructions one request costs the daemon and the client, counted by
# valgrind --tool=callgrind on the simulated device. Builds nothing: give it a configured and built build
# folder (a debugoptimized one, as `meson setup build` makes, for numbers that mean something).
#
#   tests/bench/callgrind-requests.sh BUILD_DIR [N]        N calls per phase, default 500
#
# It starts BUILD_DIR/daemon/vmmbrokerd on the simulated device with a configuration of just `[Broker]`, a
# socket of its own and a journal socket of its own that a small reader drains (so that lease events are
# made and sent as to journald), under callgrind, counting only inside on_peer_io() and on_serve(): a
# request's whole path in the daemon, from reading it to writing its answer, and nothing of the event loop
# or the idle work between requests. Then BUILD_DIR/tests/bench/callgrind-client, under callgrind too,
# counting only inside its measured_*() functions (vmmb_alloc() and vmmb_free() of the pairs, and a raw
# Status with its reply decoded), runs its phases (see callgrind-client.c): N held Allocs, their N Frees,
# N Alloc+Free pairs, N Status. The daemon writes its counts out at each phase's end
# (--dump-before=method_get_info: the client calls GetInfo there); what that marker costs is measured
# alone and taken off.
#
# Prints instructions per request, daemon and client. Needs valgrind (callgrind_annotate) and python3.
# KEEP=1 keeps the callgrind files (their folder is printed) for callgrind_annotate --inclusive=yes.
# SCOPE=loop counts the daemon inside sd_event_run() instead: every turn of its event loop, so also the
# loop's own polling and bookkeeping and whatever a request leaves for a later turn (the idle work).
set -euo pipefail

build=${1:?usage: callgrind-requests.sh BUILD_DIR [N]}
n=${2:-500}
build=$(cd "$build" && pwd)
daemon=$build/daemon/vmmbrokerd
client=$build/tests/bench/callgrind-client
libcuda=$build/tests/simcuda/libcuda.so.1
for f in "$daemon" "$client" "$libcuda"; do
        [ -e "$f" ] || { echo "callgrind-requests.sh: $f is missing: build $build first" >&2; exit 1; }
done
command -v valgrind >/dev/null && command -v callgrind_annotate >/dev/null ||
        { echo "callgrind-requests.sh: needs valgrind" >&2; exit 1; }

tmp=$(mktemp -d /tmp/vmmb-callgrind-XXXXXX)
daemon_pid= sink_pid=
cleanup() {
        [ -z "$daemon_pid" ] || kill "$daemon_pid" 2>/dev/null || true
        [ -z "$sink_pid" ] || kill "$sink_pid" 2>/dev/null || true
        wait 2>/dev/null || true
        if [ "${KEEP:-0}" = 1 ]; then echo "callgrind files kept in $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

printf '[Broker]\n' >"$tmp/empty.conf"

# The journal: a datagram socket whose reader throws every event away.
python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
while True:
    s.recv(65536)
' "$tmp/journal" &
sink_pid=$!

export VMMBROKER_LIBCUDA=$libcuda VMMBROKER_JOURNAL_SOCKET=$tmp/journal
case ${SCOPE:-request} in
request) toggles=(--toggle-collect=on_peer_io --toggle-collect=on_serve) ;;
loop) toggles=(--toggle-collect=sd_event_run) ;;
*) echo "callgrind-requests.sh: SCOPE is request or loop" >&2; exit 1 ;;
esac
valgrind --tool=callgrind --callgrind-out-file="$tmp/daemon.out" \
        "${toggles[@]}" --dump-before=method_get_info \
        "$daemon" --config "$tmp/empty.conf" --socket "$tmp/sock" 2>"$tmp/daemon.log" &
daemon_pid=$!
for _ in $(seq 600); do
        [ -S "$tmp/sock" ] && [ -S "$tmp/journal" ] && break
        kill -0 "$daemon_pid" 2>/dev/null || { cat "$tmp/daemon.log" >&2; exit 1; }
        sleep 0.1
done
[ -S "$tmp/sock" ] || { echo "callgrind-requests.sh: the daemon did not start" >&2; exit 1; }

valgrind --tool=callgrind --callgrind-out-file="$tmp/client.out" \
        --toggle-collect=measured_alloc --toggle-collect=measured_free --toggle-collect=measured_status \
        "$client" "$tmp/sock" "$n" 2>"$tmp/client.log" ||
        { cat "$tmp/client.log" >&2; exit 1; }
kill -TERM "$daemon_pid"
wait "$daemon_pid" || true
daemon_pid=

# The daemon's dumps in order; the last five are: the marker alone, Alloc, Free, pairs, Status.
totals() { sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$1"; }
mapfile -t dumps < <(ls "$tmp"/daemon.out.* | sort -t. -k3 -n)
[ ${#dumps[@]} -ge 5 ] || { echo "callgrind-requests.sh: only ${#dumps[@]} daemon dumps" >&2; exit 1; }
dumps=("${dumps[@]: -5}")
marker=$(totals "${dumps[0]}")
per() { echo $(( ($(totals "$1") - marker + n / 2) / n )); }
d_alloc=$(per "${dumps[1]}")
d_free=$(per "${dumps[2]}")
d_pair=$(per "${dumps[3]}")
d_status=$(per "${dumps[4]}")

# The client's: each measured function's inclusive count.
incl() {
        callgrind_annotate --inclusive=yes --threshold=100 "$tmp/client.out" 2>/dev/null |
                awk -v fn="$1" '!found && $0 ~ ":" fn " " { gsub(",", "", $1); print $1; found = 1 }'
}
c_alloc=$(( $(incl measured_alloc) / n ))
c_free=$(( $(incl measured_free) / n ))
c_status=$(( $(incl measured_status) / n ))

printf 'instructions per request (callgrind, simulated device, N=%s; daemon counted in %s)\n' "$n" \
        "$([ "${SCOPE:-request}" = loop ] && echo "every turn of its event loop" || echo "on_peer_io() and on_serve()")"
printf '  %-24s %10s %10s\n' "" daemon client
printf '  %-24s %10s %10s\n' "Alloc (2 MiB)" "$d_alloc" "$c_alloc"
printf '  %-24s %10s %10s\n' "Free" "$d_free" "$c_free"
printf '  %-24s %10s %10s\n' "Alloc+Free pair" "$d_pair" "$((c_alloc + c_free))"
printf '  %-24s %10s %10s\n' "Status" "$d_status" "$c_status"
printf '  (daemon: Alloc and Free held %s leases at once, pairs one; client: vmmb_alloc() and vmmb_free() of\n' "$n"
printf '  the pairs, Status as status_call(), the library way: reply read as text; the marker alone took the daemon %s)\n' "$marker"
