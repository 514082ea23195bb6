#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The installed vmmbroker.conf shows the defaults, commented out: they must be
# exactly what `vmmbrokerd --print-config` prints with no configuration at all.
# Usage: check-conf-template.sh VMMBROKERD TEMPLATE
set -eu
daemon=$1
template=$2
# (--print-config's own comments, "# ...", are not compared: the template words its own)
expected=$("$daemon" --config /nonexistent/vmmbroker.conf --print-config | grep -v -e "^$" -e "^# ")
shown=$(grep -E '^(\[[A-Za-z]+\]|#[A-Za-z]+=)' "$template" | sed 's/^#//')
if [ "$expected" != "$shown" ]; then
        echo "$template does not show the defaults that vmmbrokerd --print-config prints:" >&2
        diff <(echo "$expected") <(echo "$shown") >&2 || true
        exit 1
fi
echo "$template shows the defaults"
