#!/bin/sh
# SPDX-License-Identifier: MIT
# Checks the ABI of the built libvmmbroker: its soname, that it exports
# exactly the functions declared in vmmbroker.h, and each at the version node
# the version script puts it in (LIBVMMBROKER_0 for the first functions, a
# later node for each later set).
#   check-exports.sh NM READELF LIBRARY HEADER VERSION-SCRIPT
set -eu
nm=$1 readelf=$2 lib=$3 header=$4 script=$5
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
# Expected: "name@@NODE" for each global of each node of the version script (comments dropped).
sed 's,/\*.*\*/,,' "$script" | awk '
        /^[A-Za-z0-9_.]+ *\{/ { node = $1; sub(/\{.*/, "", node); global = 0; next }
        /^ *global: *$/ { global = 1; next }
        /^ *local: *$/ { global = 0; next }
        /^ *\}/ { node = ""; next }
        node != "" && global && /^ *[a-z_0-9]+; *$/ { name = $1; sub(/;$/, "", name); print name "@@" node }
' | sort -u >"$tmp/expected"
# Exported: defined dynamic symbols except the version nodes themselves (type A).
"$nm" -D --defined-only "$lib" | awk '$2 != "A" { print $3 }' | sort -u >"$tmp/exported"

if [ ! -s "$tmp/declared" ]; then
        echo "no function found in $header"
        fail=1
fi
if ! grep -q '@@LIBVMMBROKER_0$' "$tmp/expected"; then
        echo "no function at LIBVMMBROKER_0 in $script"
        fail=1
fi
while read -r name; do
        if ! grep -q "^$name@@" "$tmp/expected"; then
                echo "declared in vmmbroker.h but in no node of $script: $name"
                fail=1
        fi
done <"$tmp/declared"
while read -r entry; do
        if ! grep -qx "${entry%@@*}" "$tmp/declared"; then
                echo "in $script but not declared in vmmbroker.h: $entry"
                fail=1
        fi
        if ! grep -qx "$entry" "$tmp/exported"; then
                echo "not exported as $entry"
                fail=1
        fi
done <"$tmp/expected"
while read -r sym; do
        if ! grep -qx "$sym" "$tmp/expected"; then
                echo "exported but not in vmmbroker.h at its node: $sym"
                fail=1
        fi
done <"$tmp/exported"

[ "$fail" -eq 0 ] && echo "libvmmbroker exports the $(wc -l <"$tmp/declared") functions of vmmbroker.h" \
        "($(sed 's/.*@@//' "$tmp/expected" | sort -u | tr '\n' ' ' | sed 's/ $//')), soname $soname"
exit "$fail"
