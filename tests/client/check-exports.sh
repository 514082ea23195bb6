#!/bin/sh
# SPDX-License-Identifier: MIT
# Checks the ABI of the built libvmmbroker: its soname, and that it exports
# exactly the functions declared in vmmbroker.h, each at version LIBVMMBROKER_0.
#   check-exports.sh NM READELF LIBRARY HEADER
set -eu
nm=$1 readelf=$2 lib=$3 header=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

soname=$("$readelf" -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
if [ "$soname" != libvmmbroker.so.0 ]; then
        echo "soname is '$soname', want libvmmbroker.so.0"
        fail=1
fi

# Declared: every function prototype "... vmmb_name(" at the start of a line in the header.
sed -n 's/^[a-z].*[ *]\(vmmb_[a-z0-9_]*\)(.*/\1/p' "$header" | sort -u >"$tmp/declared"
# Exported: defined dynamic symbols except the version node itself (type A).
"$nm" -D --defined-only "$lib" | awk '$2 != "A" { print $3 }' | sort -u >"$tmp/exported"

if [ ! -s "$tmp/declared" ]; then
        echo "no function found in $header"
        fail=1
fi
while read -r name; do
        if ! grep -qx "$name@@LIBVMMBROKER_0" "$tmp/exported"; then
                echo "not exported at LIBVMMBROKER_0: $name"
                fail=1
        fi
done <"$tmp/declared"
while read -r sym; do
        if ! grep -qx "${sym%@@LIBVMMBROKER_0}" "$tmp/declared"; then
                echo "exported but not in vmmbroker.h: $sym"
                fail=1
        fi
done <"$tmp/exported"

[ "$fail" -eq 0 ] && echo "libvmmbroker exports the $(wc -l <"$tmp/declared") functions of vmmbroker.h, soname $soname"
exit "$fail"
