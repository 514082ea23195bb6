#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""`meson install` leaves the Python package byte-compiled, for the installed path.

    check-installed.py MESON BUILD_DIR

Installs the build into a scratch $DESTDIR (`meson install --no-rebuild`) and checks, for every module of
the installed vmmbroker package, that the byte code a Python process would load is there and valid: the
file importlib.util.cache_from_source() names, with this Python's magic number, flags 0 (checked by
the source's time stamp) and the installed source's mtime and size, and whose code names the installed
path, not the scratch one. Without it, a user who cannot write the package's __pycache__ (anyone but
root, for a system-wide install) compiles the package in every process (client/python/compile-installed.py).
Exit status 0 when every module passes.
"""

import glob
import importlib.util
import marshal
import os
import shutil
import struct
import subprocess
import sys
import tempfile


def main() -> int:
    meson, build = sys.argv[1], sys.argv[2]
    scratch = tempfile.mkdtemp(prefix="vmmbroker-install-")
    try:
        out = subprocess.run([meson, "install", "-C", build, "--no-rebuild", "--quiet", "--destdir", scratch],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            print(f"FAIL meson install: exit {out.returncode}\n{out.stdout}{out.stderr}")
            return 1
        inits = glob.glob(os.path.join(scratch, "**", "vmmbroker", "__init__.py"), recursive=True)
        if len(inits) != 1:
            print(f"FAIL the installed package: {len(inits)} vmmbroker/__init__.py under {scratch}")
            return 1
        package = os.path.dirname(inits[0])
        installed = "/" + os.path.relpath(package, scratch)
        failures = 0
        sources = sorted(glob.glob(os.path.join(package, "*.py")))
        for src in sources:
            name = os.path.basename(src)
            pyc = importlib.util.cache_from_source(src)
            why = ""
            if not os.path.exists(pyc):
                why = f"no {os.path.relpath(pyc, package)}"
            else:
                with open(pyc, "rb") as f:
                    data = f.read()
                magic, flags, mtime, size = struct.unpack("<4sIII", data[:16])
                st = os.stat(src)
                code = marshal.loads(data[16:]) if magic == importlib.util.MAGIC_NUMBER else None
                if magic != importlib.util.MAGIC_NUMBER:
                    why = "another Python's magic number"
                elif flags != 0 or mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size & 0xFFFFFFFF:
                    why = f"stale: flags {flags}, mtime {mtime} / {int(st.st_mtime)}, size {size} / {st.st_size}"
                elif code.co_filename != os.path.join(installed, name):
                    why = f"names {code.co_filename}, not {os.path.join(installed, name)}"
            print(("ok   " if not why else "FAIL ") + name + (f": {why}" if why else ""))
            failures += bool(why)
        if not sources:
            print("FAIL no module installed")
            return 1
        return 1 if failures else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
