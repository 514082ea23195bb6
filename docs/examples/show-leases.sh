#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Starts N lease-pattern processes that each lease SIZE, check it and hold it,
# then shows them with `vmmctl status` and `vmmctl list --all`, checks that
# every holder is listed, and lets them free their leases and exit.
#
#   show-leases.sh LEASE_PATTERN VMMCTL [SIZE] [N]
#
# The broker is the one at $VMMBROKER_SOCKET (or the system's). Exit status 0
# when every client verified its memory and vmmctl listed each of them.
set -u
prog=${1:?usage: show-leases.sh LEASE_PATTERN VMMCTL [SIZE] [N]}
vmmctl=${2:?usage: show-leases.sh LEASE_PATTERN VMMCTL [SIZE] [N]}
size=${3:-64M}
n=${4:-2}

dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
mkfifo "$dir/hold" "$dir/progress" || exit 1
# The clients hold their leases until the last writer of "hold" closes it: this
# script, on fd 3. Their output comes back through "progress" on fd 4. Both are
# opened read-write so that opening does not wait for the other end.
exec 3<>"$dir/hold" 4<>"$dir/progress"

pids=
i=0
while [ "$i" -lt "$n" ]; do
        "$prog" --hold "$size" <"$dir/hold" >"$dir/progress" 2>&1 3>&- 4>&- &
        pids="$pids $!"
        i=$((i + 1))
done

# Wait until every client says it holds its lease, one fails, or (a failure guard) two minutes pass.
holding=0
failed=0
while [ "$holding" -lt "$n" ] && [ "$failed" -eq 0 ]; do
        read -r -t 120 line <&4 || { echo "show-leases: the clients went silent" >&2; failed=1; break; }
        echo "$line"
        case "$line" in
        *"holding the lease"*) holding=$((holding + 1)) ;;
        *WRONG* | *cannot* | *failed*) failed=1 ;;
        esac
done

status=0
if [ "$failed" -eq 0 ]; then
        echo "\$ vmmctl status"
        "$vmmctl" status || status=1
        echo "\$ vmmctl list --all"
        "$vmmctl" list --all >"$dir/list" || status=1
        cat "$dir/list"
        for p in $pids; do
                grep -Eq "[[:space:]]$p[[:space:]]" "$dir/list" ||
                        { echo "show-leases: vmmctl list --all does not show pid $p" >&2; status=1; }
        done
else
        status=1
fi

exec 3>&-                       # the clients see end of input: they free and exit
for p in $pids; do
        wait "$p" || status=1
done
exec 4>&-
exit $status
