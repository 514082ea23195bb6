#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""check-options.py PROGRAM PAGE [--verbs]

Every long option that `PROGRAM --help` prints is documented in the man page
PAGE; with --verbs, so is every command listed under the help's "Commands:"
heading, each as a tagged paragraph (.TP, then
.B COMMAND). The page is read as roff: \\- is a minus, font escapes are dropped.
Exit status 0 when all are there, 1 otherwise (naming each one missing).
"""
import re
import subprocess
import sys


def roff_text(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = text.replace("\\-", "-").replace("\\%", "").replace("\\&", "")
    return re.sub(r"\\f(\[[^]]*\]|\(..|.)", "", text)


def help_text(program):
    r = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        sys.exit(f"FAIL: {program} --help exited with status {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def verbs_of(help_out):
    """The first word of each indented line under a "Commands:" heading, up to a blank line."""
    verbs, inside = [], False
    for line in help_out.splitlines():
        if re.match(r"^\s*(commands|verbs)\s*:?\s*$", line, re.I):
            inside = True
            continue
        if inside:
            if not line.strip() or not line[:1].isspace():
                break
            word = line.split()[0]
            if re.fullmatch(r"[a-z][a-z0-9-]*", word):
                verbs.append(word)
    return verbs


def main():
    args = [a for a in sys.argv[1:] if a != "--verbs"]
    want_verbs = "--verbs" in sys.argv[1:]
    if len(args) != 2:
        sys.exit(__doc__)
    program, page = args
    out = help_text(program)
    text = roff_text(page)

    options = sorted(set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", out)))
    if not options:
        sys.exit(f"FAIL: found no long options in the output of {program} --help")
    missing = [f"--{o}" for o in options if not re.search(rf"(?<![\w-])--{re.escape(o)}(?![\w-])", text)]

    verbs = []
    if want_verbs:
        verbs = verbs_of(out)
        if not verbs:
            sys.exit(f"FAIL: found no commands under a 'Commands:' heading in {program} --help")
        # a command is documented in a paragraph of its own, tagged with its name: .TP, then .B verb
        missing += [f"command '{v}'" for v in verbs
                    if not re.search(rf"^\.TP\n\.B\s+{re.escape(v)}\s*$", text, re.M)]

    for m in missing:
        print(f"FAIL: {m} is printed by {program} --help but not documented in {page}")
    if missing:
        return 1
    print(f"ok: {page} documents {', '.join('--' + o for o in options)}"
          + (f" and the commands {', '.join(verbs)}" if verbs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
