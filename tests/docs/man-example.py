#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""man-example.py PAGE.in OUTPUT.c: writes the first example program of the
man page's EXAMPLES section (the first .RS 4 ... .RE block) as C source, with
the roff escapes \\e and \\- turned back into \\ and -, so that the build
compiles exactly what the page shows."""
import sys

page, output = sys.argv[1:]
with open(page, encoding="utf-8") as f:
    text = f.read()
if ".SH EXAMPLES\n" not in text:
    sys.exit(f"{page}: no EXAMPLES section")
block = text.split(".SH EXAMPLES\n", 1)[1]
if ".RS 4\n" not in block:
    sys.exit(f"{page}: no .RS 4 block in EXAMPLES")
block = block.split(".RS 4\n", 1)[1].split(".RE\n", 1)[0]
if "int main(" not in block:
    sys.exit(f"{page}: the first example in EXAMPLES is not a program")
with open(output, "w", encoding="utf-8") as f:
    f.write(f"/* Generated from {page} by man-example.py: the page's example program. */\n")
    f.write(block.replace("\\e", "\\").replace("\\-", "-"))
