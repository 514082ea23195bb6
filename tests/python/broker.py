# SPDX-License-Identifier: MIT
"""A vmmbrokerd of the test's own, as tests/integration/harness.c starts one.

$VMMBROKER_DAEMON on a socket in a private directory, with the simulated
device ($VMMBROKER_LIBCUDA), a configuration file of the test's or none, and
NOTIFY_SOCKET pointing at a datagram socket where the test waits for READY=1
(bounded, and watching the daemon's pidfd so that a daemon that dies first is
noticed at once). The daemon gets SIGTERM if the test process dies.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time

READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Broker:
    def __init__(self, config: str | None = None) -> None:
        daemon = os.environ.get("VMMBROKER_DAEMON")
        if not daemon:
            raise RuntimeError("$VMMBROKER_DAEMON is not set: run the tests with `meson test python`")
        self.dir = tempfile.mkdtemp(prefix="vmmb-py-")
        os.chmod(self.dir, 0o711)             # other users reach the socket, list nothing
        self.socket = os.path.join(self.dir, "io.vmmbroker")
        notify = os.path.join(self.dir, "notify")
        config_path = os.path.join(self.dir, "vmmbroker.conf")
        if config is not None:
            with open(config_path, "w") as f:
                f.write(config)
        self.log_path = os.path.join(self.dir, "vmmbrokerd.log")
        ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            ns.bind(notify)
            env = dict(os.environ, NOTIFY_SOCKET=notify)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen([daemon, "--socket", self.socket, "--config", config_path],
                                             env=env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            self._wait_ready(ns)
        except BaseException:
            self.stop()
            raise
        finally:
            ns.close()
        os.chmod(self.socket, 0o666)

    def _wait_ready(self, ns: socket.socket) -> None:
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"vmmbrokerd sent no READY=1 within {READY_TIMEOUT_S} s:\n{self.log()}")
                readable, _, _ = select.select([ns, pidfd], [], [], left)
                if ns in readable:
                    msg = ns.recv(4096).decode("utf-8", "replace")
                    if "READY=1" in msg.split("\n"):
                        return
                    continue            # read every notification sent before an exit
                if pidfd in readable:
                    self.proc.wait()
                    raise RuntimeError(f"vmmbrokerd exited ({self.proc.returncode}) before it was ready:\n"
                                       f"{self.log()}")
        finally:
            os.close(pidfd)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, then waits (SIGKILL after 30 s); returns the exit status."""
        status = None
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        elif proc is not None:
            status = proc.returncode
        shutil.rmtree(self.dir, ignore_errors=True)
        return status
