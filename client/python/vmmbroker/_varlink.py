# SPDX-License-Identifier: MIT
"""The broker's read-only calls (Status, List) spoken directly in varlink.

libvmmbroker has no functions for them (vmmctl speaks them itself), so the
package sends them on a connection of their own: one JSON object per message,
ended by a NUL byte (docs/protocol.md). Nothing here carries file descriptors.
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Any

from ._errors import Error, error

INTERFACE = "io.vmmbroker"
#: How long one call may take before it is given up (seconds).
TIMEOUT = 30.0
#: The largest reply read (a List of every lease of a busy broker fits many times).
MAX_REPLY = 64 << 20

# The broker's errors, as libvmmbroker maps them (proto/codec.c).
_ERRNO = {
    "io.vmmbroker.OutOfMemory": errno.ENOMEM,
    "io.vmmbroker.OutOfHostMemory": errno.ENOSPC,
    "io.vmmbroker.QuotaExceeded": errno.EDQUOT,
    "io.vmmbroker.NoSuchLease": errno.ENOENT,
    "io.vmmbroker.NoSuchToken": errno.ENOKEY,
    "io.vmmbroker.NoSuchName": errno.ENOENT,
    "io.vmmbroker.NameInUse": errno.EEXIST,
    "io.vmmbroker.NoSuchDevice": errno.ENODEV,
    "io.vmmbroker.InvalidParameter": errno.EINVAL,
    "io.vmmbroker.PermissionDenied": errno.EACCES,
    "io.vmmbroker.DriverError": errno.EIO,
    "io.vmmbroker.StoreFailed": errno.EAGAIN,
    "org.varlink.service.MethodNotFound": errno.EOPNOTSUPP,
    "org.varlink.service.MethodNotImplemented": errno.EOPNOTSUPP,
    "org.varlink.service.InterfaceNotFound": errno.EOPNOTSUPP,
    "org.varlink.service.InvalidParameter": errno.EINVAL,
}


def call(path: str, method: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Calls io.vmmbroker.`method` on a new connection to `path`; returns the reply's parameters.

    Raises Error: the connection's errno when the broker cannot be reached
    (ENOENT, ECONNREFUSED, EACCES...), the broker's error mapped to an errno as
    libvmmbroker maps it, EPROTO for a reply that makes no sense.
    """
    request = json.dumps({"method": f"{INTERFACE}.{method}", "parameters": parameters or {}})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(TIMEOUT)
        try:
            s.connect(path)
            s.sendall(request.encode() + b"\0")
            data = bytearray()
            chunk = b""
            while b"\0" not in chunk:        # the new bytes only: a long reply is not scanned again each time
                chunk = s.recv(1 << 16)
                if not chunk:
                    raise Error(errno.ECONNRESET, f"The broker at {path} closed the connection "
                                                  f"before it answered {method}.")
                data += chunk
                if len(data) > MAX_REPLY:
                    raise Error(errno.EPROTO, f"The broker's reply to {method} is too long.")
        except socket.timeout:
            raise Error(errno.ETIMEDOUT, f"The broker at {path} did not answer {method} "
                                         f"within {TIMEOUT:g} s.") from None
        except Error:
            raise
        except OSError as e:
            raise error(e.errno or errno.EIO,
                        f"Cannot call {method} on the broker at {path}: {e.strerror or e}.") from None
    finally:
        s.close()
    try:
        reply = json.loads(bytes(data[:data.index(b"\0")]))
    except ValueError:
        raise Error(errno.EPROTO, f"The broker's reply to {method} is not JSON.") from None
    if not isinstance(reply, dict):
        raise Error(errno.EPROTO, f"The broker's reply to {method} is not an object.")
    params = reply.get("parameters") or {}
    if not isinstance(params, dict):
        raise Error(errno.EPROTO, f"The broker's reply to {method} has bad parameters.")
    if "error" in reply:
        name = str(reply["error"])
        message = params.get("message") if isinstance(params.get("message"), str) else None
        if not message:
            detail = ", ".join(f"{k}={v}" for k, v in params.items())
            message = f"The broker refused {method}: {name}" + (f" ({detail})." if detail else ".")
        return _raise(name, message)
    return params


def _raise(name: str, message: str) -> dict[str, Any]:
    raise error(_ERRNO.get(name, errno.EPROTO), message)
