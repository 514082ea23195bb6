#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Embeds a text file in C as `const char NAME[]`: embed.py INPUT OUTPUT NAME."""
import sys


def c_string(line):
    out = []
    for ch in line:
        if ch in '\\"':
            out.append('\\' + ch)
        elif ch == '\n':
            out.append('\\n')
        elif ch == '\t':
            out.append('\\t')
        elif ' ' <= ch <= '~':
            out.append(ch)
        else:
            # any other byte as an octal escape, so the C string is plain ASCII
            out.extend('\\%03o' % b for b in ch.encode('utf-8'))
    return '"' + ''.join(out) + '"'


def main():
    src, dst, name = sys.argv[1:4]
    with open(src, encoding='utf-8') as f:
        text = f.read()
    if '\0' in text:
        sys.exit('%s: holds a NUL byte' % src)
    lines = text.splitlines(keepends=True) or ['']
    with open(dst, 'w', encoding='ascii') as f:
        f.write('/* Generated from %s by embed.py; do not edit. */\n' % src.split('/')[-1])
        f.write('extern const char %s[];\n' % name)
        f.write('const char %s[] =\n' % name)
        for line in lines:
            f.write('        %s\n' % c_string(line))
        f.write('        ;\n')


if __name__ == '__main__':
    main()
