#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A daemon that cannot serve, started as systemd starts it, without systemd.

Starts vmmbrokerd as vmmbroker.socket does (LISTEN_FDS=1, LISTEN_FDNAMES=varlink, a client already
waiting on the socket) with $NOTIFY_SOCKET pointing at a socket of this test, and checks for each case
the exit status (vmmbrokerd(8), EXIT STATUS; vmmbroker.service's RestartPreventExitStatus=2 6), the
STATUS= line (what `systemctl status` shows), and what happened to the waiting client: closed at once
when starting again cannot help, left waiting for the next start when it may.
tests/systemd/boot-test.sh checks the same under the real systemd where a container can be booted.

    check-cannot-serve.py VMMBROKERD SIMCUDA_LIB
"""
import array
import os
import select
import socket
import subprocess
import sys
import tempfile
import time

daemon, simcuda = sys.argv[1], sys.argv[2]
failures = 0


def run(name, env, args, want_status, want_status_text, want_closed):
    global failures
    with tempfile.TemporaryDirectory() as tmp:
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listen.bind(os.path.join(tmp, "io.vmmbroker"))
        listen.listen(16)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(os.path.join(tmp, "io.vmmbroker"))     # waits in the backlog, as the first client does
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(tmp, "notify"))

        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LISTEN_FDS": "1",
                    "LISTEN_FDNAMES": "varlink", "NOTIFY_SOCKET": os.path.join(tmp, "notify"),
                    "VMMBROKER_LIBCUDA": simcuda, "SIMCUDA_MEMORY": "256M"}
        for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LD_LIBRARY_PATH"):
            if k in os.environ:
                full_env[k] = os.environ[k]
        full_env.update(env)
        start = time.monotonic()
        proc = subprocess.Popen(["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", daemon,
                                 "--config", os.path.join(tmp, "none.conf")] + args,
                                env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                # The daemon gets the socket as fd 3 (SD_LISTEN_FDS_START); this process keeps
                                # its own, as systemd does, so that the socket outlives the daemon.
                                preexec_fn=lambda: os.dup2(listen.fileno(), 3), pass_fds=(3,))

        # Read notifications until the daemon exits; answer BARRIER=1 by closing its fd, as systemd does.
        messages = []
        while True:
            r, _, _ = select.select([notify], [], [], 0.1)
            if r:
                fds = array.array("i")
                data, anc, _, _ = notify.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
                messages.append(data.decode())
                continue
            if proc.poll() is not None or time.monotonic() - start > 30:
                break
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace").strip()
        took = time.monotonic() - start

        status_lines = [line[7:] for m in messages for line in m.split("\n") if line.startswith("STATUS=")]
        client.setblocking(False)
        try:
            closed = client.recv(1) == b""
        except BlockingIOError:
            closed = False                      # still waiting in the backlog, for the next start
        except ConnectionResetError:
            closed = True
        client.close()
        notify.close()
        listen.close()

        problems = []
        if proc.returncode != want_status:
            problems.append(f"exit status {proc.returncode}, expected {want_status}")
        if not any(want_status_text in s for s in status_lines):
            problems.append(f"no STATUS= with \"{want_status_text}\" (got {status_lines})")
        if "BARRIER=1" not in "\n".join(messages):
            problems.append("no BARRIER=1 after STATUS=")
        if closed != want_closed:
            problems.append("the waiting client was " + ("closed" if closed else "left waiting"))
        if took > 10:
            problems.append(f"took {took:.1f} s")
        if problems:
            failures += 1
            print(f"FAIL: {name}: " + "; ".join(problems) + f"\n      output: {output}")
        else:
            print(f"ok: {name}: exit {proc.returncode} in {took:.2f} s, STATUS={status_lines[-1]!r}, "
                  f"waiting client {'closed' if closed else 'left waiting'}")


run("no driver", {"VMMBROKER_LIBCUDA": "/nonexistent/libcuda.so.1"}, [], 6, "Cannot serve: No CUDA driver", True)
run("no device", {"SIMCUDA_DEVICES": "0"}, [], 6, "Cannot serve: No CUDA device", True)
run("driver too old", {"SIMCUDA_DRIVER_VERSION": "11080"}, [], 6, "Cannot serve: CUDA driver too old", True)
run("a capacity the device cannot hold", {}, ["--capacity", "1K"], 6, "Cannot serve: Capacity=1K", True)
run("bad configuration", {}, ["--max-slab", "3M"], 2, "Bad configuration: --max-slab: MaxSlab=3M", True)
run("bad command line", {}, ["--no-such-option"], 2, "Bad command line", True)
run("a failure that may pass (cuStreamCreate fails)", {"SIMCUDA_FAIL": "cuStreamCreate:1"}, [], 1,
    "Cannot start, retrying: Cannot set up CUDA device 0", False)
sys.exit(1 if failures else 0)
