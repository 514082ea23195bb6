#!/bin/sh
# SPDX-License-Identifier: MIT
# Runs N lease-pattern processes at once against the broker ($VMMBROKER_SOCKET);
# exits 0 when every one verified its own pattern.  Usage: run-pair.sh PROGRAM [SIZE] [N]
prog=${1:?usage: run-pair.sh PROGRAM [SIZE] [N]}
size=${2:-64M}
n=${3:-2}
pids=
i=0
while [ "$i" -lt "$n" ]; do
        "$prog" "$size" &
        pids="$pids $!"
        i=$((i + 1))
done
status=0
for p in $pids; do
        wait "$p" || status=1
done
exit $status
