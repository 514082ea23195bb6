#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Meson install script: byte-compiles the installed vmmbroker package.

    compile-installed.py INSTALLED_PACKAGE_DIR

A system-wide install is root's: any other user's Python cannot write the
package's __pycache__, and without it compiles every module of the package
again in every process that imports it: `import vmmbroker, vmmbroker.weights`
took 51-53 ms so and 26-27 ms with the byte code (medians of 11 processes,
2-core development VM, no PyTorch; docs/python.md, "Install"). Debian's Meson 1.0 does not
byte-compile what python.install_sources() installs (Meson 1.2 does), so this
does, for the Python that runs Meson, honouring $DESTDIR. The byte code names
the installed path, not the staging one, as tracebacks should. Exit status 0,
or 1 when a module does not compile.
"""

import compileall
import os
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if os.environ.get("MESON_INSTALL_DRY_RUN"):
        return 0
    target = sys.argv[1]
    destdir = os.environ.get("DESTDIR", "")
    path = os.path.join(destdir, os.path.relpath(target, "/")) if destdir else target
    quiet = 1 if os.environ.get("MESON_INSTALL_QUIET") else 0
    ok = compileall.compile_dir(path, ddir=target, quiet=quiet, force=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
