#!/bin/sh
# SPDX-License-Identifier: MIT
# check-idl.sh GENERATOR FILE: parses a varlink interface file with the varlink
# reference implementation's Go generator (Debian's varlink-go), which refuses
# anything that is not strict varlink IDL. The generator writes its output
# next to the file, so it works on a copy in a temporary folder.
set -eu
gen=$1
file=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp "$file" "$dir/"
"$gen" "$dir/$(basename "$file")"
