#!/bin/sh
# SPDX-License-Identifier: MIT
#
# check-man.sh PAGE: PAGE formats with groff's man macros with no warning of
# any kind (-ww) and no error. groff exits 0 even when it warns, so any output
# on stderr fails the check.
set -eu
page=$1

if ! command -v groff >/dev/null 2>&1; then
        echo "groff is not installed (Debian: apt-get install groff-base; ./dev.sh installs it); skipping"
        exit 77
fi
[ -s "$page" ] || { echo "FAIL: $page is missing or empty"; exit 1; }

status=0
warnings=$(groff -man -ww -z -Tutf8 "$page" 2>&1) || status=$?
if [ "$status" -ne 0 ] || [ -n "$warnings" ]; then
        printf '%s\n' "$warnings"
        echo "FAIL: groff -man -ww -z -Tutf8 $page: exit status $status, output above"
        exit 1
fi
echo "ok: $page formats without warnings"
