#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""check-functions.py HEADER PAGE DOCS_MESON

Every function that HEADER (include/vmmbroker.h) declares is documented in the
man page PAGE (libvmmbroker.3.in): named under NAME, declared in the SYNOPSIS
and described as a tagged paragraph (.TP, then .BR FUNCTION ()); and
DOCS_MESON (docs/meson.build) installs a FUNCTION.3 link to the page, so that
`man FUNCTION` opens it. Nor does the page name a vmmb_ function the header
lacks. Exit status 0 when all are there, 1 otherwise (naming each one missing).
"""
import re
import sys

header, page, docs_meson = sys.argv[1:]
with open(header, encoding="utf-8") as f:
    declared = sorted(set(re.findall(r"^[a-z].*?[ *](vmmb_[a-z0-9_]*)\(", f.read(), re.M)))
with open(page, encoding="utf-8") as f:
    text = f.read().replace("\\-", "-")
with open(docs_meson, encoding="utf-8") as f:
    meson = f.read()

if not declared:
    sys.exit(f"FAIL: no function found in {header}")
sections = dict(re.findall(r"^\.SH (\S+)\n(.*?)(?=^\.SH |\Z)", text, re.M | re.S))
name, synopsis, description = (sections.get(s, "") for s in ("NAME", "SYNOPSIS", "DESCRIPTION"))
links = re.search(r"foreach fn : \[(.*?)\]\s*install_symlink", meson, re.S)
linked = set(re.findall(r"'([a-z0-9_]+)'", links.group(1))) if links else set()

missing = []
for fn in declared:
    if not re.search(rf"\b{fn}\b", name):
        missing.append(f"{fn}: not named under NAME")
    if not re.search(rf"[ *]{fn}\(", synopsis):
        missing.append(f"{fn}: not declared in the SYNOPSIS")
    if not re.search(rf"^\.TP\n\.BR {fn} \(\)$", description, re.M):
        missing.append(f"{fn}: no tagged paragraph (.TP, .BR {fn} ()) in DESCRIPTION")
    if fn not in linked:
        missing.append(f"{fn}: no {fn}.3 link in {docs_meson}")
for fn in sorted(set(re.findall(r"\bvmmb_[a-z0-9_]+\b", name)) - set(declared)):
    missing.append(f"{fn}: named under NAME but not declared in {header}")
for fn in sorted(linked - set(declared)):
    missing.append(f"{fn}: linked in {docs_meson} but not declared in {header}")

for m in missing:
    print(f"FAIL: {m}")
if missing:
    sys.exit(1)
print(f"ok: the {len(declared)} functions of {header} are in {page} and linked to it")
