#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""check-protocol.py INTERFACE.varlink PROTOCOL.md

Every method, type and error declared in the varlink interface file is
documented in PROTOCOL.md: each has a row of a Markdown table that starts with
its name in backticks (| `Alloc` | ...), and that row names every field of the
declaration (for a method, every parameter and every reply field). Exit status
0 when all are there, 1 otherwise (naming each one missing).
"""
import re
import sys


def declarations(path):
    """[(kind, name, [field names])] in the order of the file."""
    with open(path, encoding="utf-8") as f:
        text = "\n".join(line.split("#", 1)[0] for line in f)
    decls = []
    # each declaration runs to the next one
    parts = re.split(r"^\s*(method|type|error)\s+([A-Za-z][A-Za-z0-9]*)", text, flags=re.M)
    for i in range(1, len(parts), 3):
        kind, name, body = parts[i], parts[i + 1], parts[i + 2]
        fields = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", body)
        decls.append((kind, name, list(dict.fromkeys(fields))))
    return decls


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    interface, doc = sys.argv[1:]
    decls = declarations(interface)
    if not decls:
        sys.exit(f"FAIL: found no declarations in {interface}")
    with open(doc, encoding="utf-8") as f:
        rows = [line for line in f if line.lstrip().startswith("|")]

    problems = []
    for kind, name, fields in decls:
        row = next((r for r in rows if re.match(rf"\s*\|\s*`{name}`\s*\|", r)), None)
        if row is None:
            problems.append(f"{kind} {name} has no table row (| `{name}` | ...)")
            continue
        for field in fields:
            if not re.search(rf"(?<![\w.]){field}(?!\w)", row):
                problems.append(f"{kind} {name}: its row does not name the field '{field}'")

    for p in problems:
        print(f"FAIL: {p} in {doc}, though {interface} declares it")
    if problems:
        return 1
    counts = {k: sum(1 for d in decls if d[0] == k) for k in ("method", "type", "error")}
    print(f"ok: {doc} documents the {counts['method']} methods, {counts['type']} types and "
          f"{counts['error']} errors of {interface}, with their fields")
    return 0


if __name__ == "__main__":
    sys.exit(main())
