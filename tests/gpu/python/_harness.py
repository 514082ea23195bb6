# SPDX-License-Identifier: MIT
"""What the GPU programs of tests/gpu/python share: finding the package and the library, a private broker, a table.

Environment (all optional):
  VMMBROKER_BUILD    the build folder, relative to the repository or absolute (default: build)
  VMMBROKER_LIBRARY  libvmmbroker (default: BUILD/client/libvmmbroker.so.0 when it exists)
  VMMBROKER_DAEMON   vmmbrokerd (default: BUILD/daemon/vmmbrokerd)
  VMMBROKER_SOCKET   a broker that runs already; when unset, broker() starts one on a private socket
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _build_dir() -> str:
    b = os.environ.get("VMMBROKER_BUILD", "build")
    return b if os.path.isabs(b) else os.path.join(REPO, b)


def setup_paths() -> None:
    """Make `import vmmbroker` find the tree's package and the build's library (also for child processes)."""
    pkg = os.path.join(REPO, "client", "python")
    if pkg not in sys.path:
        sys.path.insert(0, pkg)
    pp = os.environ.get("PYTHONPATH", "")
    if pkg not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = pkg + (os.pathsep + pp if pp else "")
    if not os.environ.get("VMMBROKER_LIBRARY"):
        lib = os.path.join(_build_dir(), "client", "libvmmbroker.so.0")
        if os.path.exists(lib):
            os.environ["VMMBROKER_LIBRARY"] = lib
    carry = os.path.join(REPO, ".carry", "lib")      # libraries the GPU machine lacks (tests/gpu/run.sh)
    if os.path.isdir(carry):
        ld = os.environ.get("LD_LIBRARY_PATH", "")
        if carry not in ld.split(os.pathsep):
            os.environ["LD_LIBRARY_PATH"] = carry + (os.pathsep + ld if ld else "")


def _accepts(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


@contextlib.contextmanager
def broker(timeout: float = 30.0, log: Optional[str] = None, args: Sequence[str] = (),
           config: Optional[str] = None) -> Iterator[str]:
    """A broker for the block: $VMMBROKER_SOCKET's if set, else a vmmbrokerd of our own on a private socket.

    Sets $VMMBROKER_SOCKET for this process and its children; yields the socket path.
    The daemon's output goes to LOG (default: $OUT/vmmbrokerd-PID.log, else a temporary file).
    ARGS are added to its command line; CONFIG, when given, is its vmmbroker.conf (none otherwise).
    """
    setup_paths()
    existing = os.environ.get("VMMBROKER_SOCKET")
    if existing:
        yield existing
        return
    daemon = os.environ.get("VMMBROKER_DAEMON") or os.path.join(_build_dir(), "daemon", "vmmbrokerd")
    if not os.access(daemon, os.X_OK):
        raise SystemExit(f"no vmmbrokerd at {daemon}: set VMMBROKER_DAEMON or VMMBROKER_BUILD")
    tmp = tempfile.mkdtemp(prefix="vmmb-py-")
    path = os.path.join(tmp, "io.vmmbroker")
    if log is None:
        out = os.environ.get("OUT")
        log = os.path.join(out if out and os.path.isdir(out) else tmp, f"vmmbrokerd-{os.getpid()}.log")
    logf = open(log, "ab")
    conf = "/nonexistent"
    if config is not None:
        conf = os.path.join(tmp, "vmmbroker.conf")
        with open(conf, "w") as f:
            f.write(config)
    proc = subprocess.Popen([daemon, "--socket", path, "--config", conf, *args],
                            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not _accepts(path):
            if proc.poll() is not None:
                raise SystemExit(f"vmmbrokerd exited with status {proc.returncode} (log: {log})")
            if time.monotonic() > deadline:
                raise SystemExit(f"vmmbrokerd did not listen on {path} within {timeout:.0f} s (log: {log})")
            time.sleep(0.05)
        os.environ["VMMBROKER_SOCKET"] = path
        yield path
    finally:
        os.environ.pop("VMMBROKER_SOCKET", None)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        logf.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run_self(script: str, args: Sequence[str], timeout: float = 600, env: Optional[dict] = None) -> str:
    """Run SCRIPT ARGS in a new Python process with our environment; return its stdout (stderr passes through)."""
    e = dict(os.environ)
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, script, *args], stdout=subprocess.PIPE, env=e, timeout=timeout)
    out = p.stdout.decode("utf-8", "replace")
    if p.returncode != 0:
        sys.stdout.write(out)
        raise SystemExit(f"{os.path.basename(script)} {' '.join(args)}: exit status {p.returncode}")
    return out


def last_json(out: str):
    """The last line of OUT that starts with '{', parsed."""
    import json
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("child printed no JSON result")


def table(title: str, header: Sequence[str], rows: List[Sequence[object]]) -> None:
    """Print a small aligned table (the last thing each program prints)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print()
    print(f"== {title}")
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def start_child(target, socket_path: str):
    """TARGET(SOCKET_PATH, pipe) in a new process (multiprocessing's spawn: no CUDA state inherited), once it has
    sent "ready" on the pipe: (this end of the pipe, the process). The process is a daemon: not waited for at exit."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(socket_path, theirs), daemon=True)
    child.start()
    got = mine.recv()
    if got != "ready":
        raise SystemExit(f"the child process said {got!r}, not ready")
    return mine, child


def park_while_other_parks(lease, pipe, delay_s: float) -> Tuple[int, int, int, int]:
    """Parks LEASE, telling the child at the other end of PIPE (start_child()) to "park" DELAY_S into it; returns
    (start, end) of this park and (start, end) of the child's as it sent them back, in CLOCK_MONOTONIC ns."""
    timer = threading.Timer(delay_s, lambda: pipe.send("park"))
    t0 = time.monotonic_ns()
    timer.start()
    lease.park()
    t1 = time.monotonic_ns()
    timer.join()
    b0, b1 = pipe.recv()
    return t0, t1, b0, b1


def park_config(gib: int) -> str:
    """vmmbroker.conf for a park of GIB GiB by one user: HostCapacity= above it, MaxHostBytes=100%."""
    return f"[Broker]\nHostCapacity={gib + 1}G\n[Limits]\nMaxHostBytes=100%\n"


def status_observer(socket_path: str, pipe) -> None:
    """A process that calls Status on the broker at SOCKET_PATH while another times something (kept_stall.py,
    park_stall.py): on "go" from PIPE (a multiprocessing Pipe end), Status back to back, "ready" after the
    first, until the next message; then sends back each call's (start, end) in perf_counter_ns."""
    setup_paths()
    import vmmbroker

    clock = time.perf_counter_ns
    with vmmbroker.connect(socket_path) as c:
        c.status()
        while pipe.recv() == "go":
            calls = []
            t0 = clock()
            c.status()
            calls.append((t0, clock()))
            pipe.send("ready")
            while not pipe.poll():
                t0 = clock()
                c.status()
                calls.append((t0, clock()))
            pipe.recv()
            pipe.send(calls)


def loop_dispatches(socket_path: str) -> Optional[dict]:
    """The broker's vmmbroker_loop_dispatch_seconds buckets as {(source, le): cumulative count}, by `vmmctl
    metrics` (an administrator's: None when this user may not read them, or vmmctl is not built)."""
    vmmctl = os.environ.get("VMMCTL") or os.path.join(_build_dir(), "client", "vmmctl")
    try:
        r = subprocess.run([vmmctl, "--socket", socket_path, "metrics"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("vmmbroker_loop_dispatch_seconds_bucket{"):
            labels, value = line[len("vmmbroker_loop_dispatch_seconds_bucket{"):].split("} ")
            kv = dict(item.split("=", 1) for item in labels.split(","))
            out[(kv["source"].strip('"'), float(kv["le"].strip('"')))] = int(value)
    return out


def long_dispatches(before: Optional[dict], after: Optional[dict], over_s: float = 0.001) -> str:
    """The loop's dispatches longer than OVER_S between two loop_dispatches(): "SOURCE N (<= BOUND ms)" for each
    source that had any, BOUND the smallest bucket that holds them all; "none", or "-" when not known."""
    if before is None or after is None:
        return "-"
    said = []
    for source in sorted({s for s, _ in after}):
        def delta(le):
            return after.get((source, le), 0) - before.get((source, le), 0)
        bounds = sorted(le for s, le in after if s == source)
        n = delta(float("inf")) - delta(max((b for b in bounds if b <= over_s), default=0.0))
        if n > 0:
            top = min(b for b in bounds if delta(b) == delta(float("inf")))
            said.append(f"{source} {n} (<= {top * 1e3:g} ms)" if top != float("inf") else f"{source} {n} (> 1 s)")
    return ", ".join(said) or "none"


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
