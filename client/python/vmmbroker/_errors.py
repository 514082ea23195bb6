# SPDX-License-Identifier: MIT
"""The package's exceptions: Error and the few subclasses worth catching on their own."""

from __future__ import annotations

import errno as _errno
import os

__all__ = ["Error", "NotFound", "PermissionDenied", "QuotaExceeded", "OutOfMemory", "OutOfHostMemory"]


class Error(OSError):
    """A call to the broker or to libvmmbroker failed.

    ``errno`` is the error number (positive: ``errno.EINVAL``, not -22) and
    ``strerror`` the broker's or the library's sentence for a person
    (vmmb_error_message()); ``str(e)`` shows both. The subclasses below are
    raised for the errnos they name; everything else is an ``Error``.
    """
    __module__ = "vmmbroker"

    def __init__(self, errno: int, message: str | None = None) -> None:
        if not message:
            message = os.strerror(errno)
        super().__init__(errno, message)

    @property
    def message(self) -> str:
        """The sentence alone (the same as ``strerror``)."""
        return self.strerror or ""


class NotFound(Error):
    """ENOENT or ENOKEY: no such lease or name (a name the caller may not attach
    reads the same), or no live lease has the token (mistyped, revoked, or ended)."""
    __module__ = "vmmbroker"


class PermissionDenied(Error):
    """EACCES: the caller may not do this (not the lease's owner, a read-only
    hold asked to write, not allowed to reach the broker)."""
    __module__ = "vmmbroker"


class QuotaExceeded(Error):
    """EDQUOT: a limit of the calling user (bytes, leases, connections; for a
    parked lease, host bytes: the message names "host_bytes") or of the lease
    (64 live tokens) would be exceeded; nothing was changed."""
    __module__ = "vmmbroker"


class OutOfMemory(Error):
    """ENOMEM: the device has no room for the request now."""
    __module__ = "vmmbroker"


class OutOfHostMemory(Error):
    """ENOSPC: the broker's host memory for parked leases (io.vmmbroker.OutOfHostMemory) has no room
    for the lease's content now; Lease.park() left the lease mapped, as it was."""
    __module__ = "vmmbroker"


_BY_ERRNO = {
    _errno.ENOENT: NotFound,
    _errno.ENOKEY: NotFound,
    _errno.EACCES: PermissionDenied,
    _errno.EDQUOT: QuotaExceeded,
    _errno.ENOMEM: OutOfMemory,
    _errno.ENOSPC: OutOfHostMemory,
}


def error(errno: int, message: str | None = None) -> Error:
    """The exception for a positive or negative errno and its sentence."""
    errno = abs(errno)
    return _BY_ERRNO.get(errno, Error)(errno, message)
