#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""check-metrics.py VMMCTL

Run by with-daemon (VMMBROKER_SOCKET names a daemon of its own on the simulated
device, VMMBROKER_JOURNAL_SOCKET where it sends its journal events). Makes
leases over raw varlink, then checks:

  - `vmmctl metrics` parses with the Prometheus client's OpenMetrics parser
    (Debian's python3-prometheus-client), every family is vmmbroker_*, the
    values follow what was done (leases, bytes, requests by method and outcome,
    latency histograms, lease events), and the text ends with "# EOF";
  - the lease events reach the journal socket with their MESSAGE_ID and
    VMMBROKER_* fields;
  - a user who is no administrator gets PermissionDenied (when run as root);
  - `vmmctl top` prints one frame when stdout is no terminal, and `--once`.

Exit status 0 when all hold, 77 (skipped) without the parser, 1 otherwise.
"""
import array
import json
import os
import pwd
import socket
import subprocess
import sys

try:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
except ImportError:
    print("SKIP: no prometheus_client (apt-get install python3-prometheus-client)")
    sys.exit(77)

MiB = 1 << 20
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


class Conn:
    """A varlink connection; replies' fds are closed at once (the lease stays: this process holds it)."""

    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(30)
        self.s.connect(path)
        self.buf = b""

    def call(self, method, **params):
        self.s.sendall(json.dumps({"method": method, "parameters": params}).encode() + b"\0")
        while b"\0" not in self.buf:
            data, ancdata, _, _ = self.s.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    for fd in fds:
                        os.close(fd)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.buf += data
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)


def metrics(vmmctl, **kw):
    r = subprocess.run([vmmctl, "metrics"], capture_output=True, text=True, timeout=60, **kw)
    return r


def parse(text):
    families = {}
    for f in text_string_to_metric_families(text):
        families[f.name] = f
    return families


def value(families, family, sample, **labels):
    f = families.get(family)
    if not f:
        return None
    for s in f.samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def journal_events(sock):
    events = []
    sock.settimeout(0.2)
    while True:
        try:
            data = sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            return events
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        events.append(fields)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    vmmctl = sys.argv[1]
    path = os.environ["VMMBROKER_SOCKET"]
    journal_path = os.environ.get("VMMBROKER_JOURNAL_SOCKET")
    journal = None
    if journal_path:
        try:
            os.unlink(journal_path)
        except FileNotFoundError:
            pass
        journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        journal.bind(journal_path)

    # A child holds lease A until its pipe closes, then exits: the broker reclaims it.
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(up_r)
        os.close(down_w)
        a = Conn(path).call("io.vmmbroker.Alloc", size=64 * MiB, label="metrics-a")
        os.write(up_w, json.dumps(a).encode())
        os.close(up_w)
        os.read(down_r, 1)
        os._exit(0)
    os.close(up_w)
    os.close(down_r)
    a = json.loads(os.read(up_r, 65536))
    os.close(up_r)
    c = Conn(path)
    b = c.call("io.vmmbroker.Alloc", size=32 * MiB)
    check("error" not in a and "error" not in b, f"Alloc: {a.get('error')} {b.get('error')}")
    lease_a = a["parameters"]["lease"]["id"]
    lease_b = b["parameters"]["lease"]["id"]
    r = c.call("io.vmmbroker.Publish", id=lease_b, name="metrics-b")
    check("error" not in r, f"Publish: {r}")
    r = c.call("io.vmmbroker.Free", id="0" * 32)
    check(r.get("error") == "io.vmmbroker.NoSuchLease", f"Free of no lease: {r}")
    r = c.call("io.vmmbroker.Free", id=lease_b)       # published: it stays
    check("error" not in r, f"Free: {r}")
    for method in ("Park", "Unpark", "SetReclaimable"):      # counted under their own names, not "other"
        r = c.call("io.vmmbroker." + method, id="0" * 32)
        check(r.get("error") == "io.vmmbroker.NoSuchLease", f"{method} of no lease: {r}")

    r = metrics(vmmctl)
    check(r.returncode == 0, f"vmmctl metrics exited {r.returncode}: {r.stderr}")
    text = r.stdout
    check(text.endswith("# EOF\n"), "the text does not end with '# EOF'")
    try:
        fam = parse(text)
    except ValueError as e:
        check(False, f"the Prometheus parser refused the text: {e}")
        fam = {}
    bad = [n for n in fam if not n.startswith("vmmbroker_")]
    check(not bad, f"families without the vmmbroker_ prefix: {bad}")
    for name, typ in [("vmmbroker_device_capacity_bytes", "gauge"), ("vmmbroker_device_leased_bytes", "gauge"),
                      ("vmmbroker_device_cached_bytes", "gauge"), ("vmmbroker_device_scrubbing_bytes", "gauge"),
                      ("vmmbroker_device_leases", "gauge"), ("vmmbroker_device_waiters", "gauge"),
                      ("vmmbroker_device_scrub_waits", "counter"),
                      ("vmmbroker_device_slabs_mapped_ahead", "counter"),
                      ("vmmbroker_device_host_slabs_kept", "counter"),
                      ("vmmbroker_user_bytes", "gauge"), ("vmmbroker_user_leases", "gauge"),
                      ("vmmbroker_user_connections", "gauge"), ("vmmbroker_requests", "counter"),
                      ("vmmbroker_request_duration_seconds", "histogram"), ("vmmbroker_restarted", "gauge"),
                      ("vmmbroker_loop_dispatch_seconds", "histogram"),
                      ("vmmbroker_leases_restored", "gauge"), ("vmmbroker_store_failures", "counter"),
                      ("vmmbroker_store_generation", "gauge"), ("vmmbroker_store_commits", "counter"),
                      ("vmmbroker_lease_events", "counter"), ("vmmbroker_build", "info")]:
        check(name in fam and fam[name].type == typ,
              f"{name}: {'missing' if name not in fam else 'type ' + fam[name].type}, not {typ}")
    for name in ["vmmbroker_device_capacity_bytes", "vmmbroker_request_duration_seconds",
                 "vmmbroker_loop_dispatch_seconds"]:
        unit = name.rsplit("_", 1)[1]
        check(name in fam and fam[name].unit == unit, f"{name} has no UNIT {unit}")
    uid = str(os.getuid())
    check(value(fam, "vmmbroker_device_leased_bytes", "vmmbroker_device_leased_bytes", device="0") == 96 * MiB,
          "device 0 leased bytes are not 96 MiB")
    check(value(fam, "vmmbroker_device_leases", "vmmbroker_device_leases", device="0") == 2, "device 0 leases != 2")
    check(value(fam, "vmmbroker_user_bytes", "vmmbroker_user_bytes", uid=uid, device="0") == 96 * MiB,
          f"user {uid}'s bytes are not 96 MiB")
    check(value(fam, "vmmbroker_user_leases", "vmmbroker_user_leases", uid=uid) == 2, "user's leases != 2")
    check((value(fam, "vmmbroker_user_connections", "vmmbroker_user_connections", uid=uid) or 0) >= 2,
          "user's connections < 2 (this script's and vmmctl's)")
    check(value(fam, "vmmbroker_requests", "vmmbroker_requests_total", method="Alloc", outcome="ok") == 2,
          "requests_total{Alloc,ok} != 2")
    check(value(fam, "vmmbroker_requests", "vmmbroker_requests_total", method="Free", outcome="NoSuchLease") == 1,
          "requests_total{Free,NoSuchLease} != 1")
    for method in ("Park", "Unpark", "SetReclaimable"):
        check(value(fam, "vmmbroker_requests", "vmmbroker_requests_total", method=method,
                    outcome="NoSuchLease") == 1, f"requests_total{{{method},NoSuchLease}} != 1")
    others = [s.labels for s in fam["vmmbroker_requests"].samples if s.labels.get("method") == "other"] \
        if "vmmbroker_requests" in fam else []
    check(not others, f"methods of the interface counted as other: {others}")
    check(value(fam, "vmmbroker_request_duration_seconds", "vmmbroker_request_duration_seconds_count",
                method="Alloc") == 2, "the Alloc histogram's count != 2")
    check(value(fam, "vmmbroker_request_duration_seconds", "vmmbroker_request_duration_seconds_bucket",
                method="Alloc", le="+Inf") == 2, "the Alloc histogram's +Inf bucket != 2")
    # The loop's dispatches: each named by its handler (none "other" while the daemon runs), by names that
    # docs/metrics.md gives; this script's requests were read and served by dispatches of its connection.
    sources = {s.labels.get("source", "") for s in fam["vmmbroker_loop_dispatch_seconds"].samples} \
        if "vmmbroker_loop_dispatch_seconds" in fam else set()
    documented = {"connection", "serve", "accept", "device", "holder_exit", "waiters", "idle", "tick", "reclaim",
                  "scrub", "deadline", "signal"}
    check(sources and sources <= documented, f"loop dispatch sources {sorted(sources)}, not among {sorted(documented)}")
    for source in sources:
        count = value(fam, "vmmbroker_loop_dispatch_seconds", "vmmbroker_loop_dispatch_seconds_count", source=source)
        check(count == value(fam, "vmmbroker_loop_dispatch_seconds", "vmmbroker_loop_dispatch_seconds_bucket",
                             source=source, le="+Inf"), f"loop dispatches of {source}: count != the +Inf bucket")
    check((value(fam, "vmmbroker_loop_dispatch_seconds", "vmmbroker_loop_dispatch_seconds_count",
                 source="connection") or 0) >= 6, "fewer than 6 dispatches of a connection for this script's requests")
    # Every kind of lease event has its sample, named as docs/metrics.md names them, and no other.
    kinds = sorted(s.labels.get("event", "") for s in fam["vmmbroker_lease_events"].samples) \
        if "vmmbroker_lease_events" in fam else []
    check(kinds == sorted(["made", "ended", "reclaimed", "published", "unpublished", "parked", "unparked",
                           "store_failed", "store_recovered"]), f"lease event kinds: {kinds}")
    check(value(fam, "vmmbroker_lease_events", "vmmbroker_lease_events_total", event="made") == 2, "made != 2")
    check(value(fam, "vmmbroker_lease_events", "vmmbroker_lease_events_total", event="published") == 1,
          "published != 1")
    check(value(fam, "vmmbroker_restarted", "vmmbroker_restarted") == 0, "a first start counts as a restart")
    # Nothing waits off the loop here; the three reasons are there all the same (test-park counts real waits).
    reasons = sorted(s.labels.get("reason", "") for s in fam["vmmbroker_calls_waiting"].samples) \
        if "vmmbroker_calls_waiting" in fam else []
    check(reasons == ["copy", "host_memory", "zeroing"], f"calls_waiting reasons: {reasons}")
    for reason in reasons:
        check(value(fam, "vmmbroker_calls_waiting", "vmmbroker_calls_waiting", reason=reason) == 0,
              f"calls_waiting{{{reason}}} != 0 with no call waiting")

    # The holder exits: its lease is reclaimed and ends; the published one stays until unpublished.
    os.close(down_w)
    os.waitpid(holder, 0)
    r = c.call("io.vmmbroker.Unpublish", name="metrics-b")
    check("error" not in r, f"Unpublish: {r}")
    r = c.call("io.vmmbroker.Status")
    fam = parse(metrics(vmmctl).stdout)
    check(value(fam, "vmmbroker_device_leased_bytes", "vmmbroker_device_leased_bytes", device="0") == 0,
          "leased bytes after the ends are not 0")
    for event, n in [("reclaimed", 1), ("ended", 2), ("unpublished", 1)]:
        got = value(fam, "vmmbroker_lease_events", "vmmbroker_lease_events_total", event=event)
        check(got == n, f"lease events {event}: {got}, not {n}")

    if journal:
        events = journal_events(journal)
        kinds = [e.get("VMMBROKER_EVENT") for e in events]
        check(kinds.count("made") == 2 and kinds.count("ended") == 2 and "reclaimed" in kinds
              and "published" in kinds and "unpublished" in kinds, f"journal events: {kinds}")
        made = [e for e in events if e.get("VMMBROKER_EVENT") == "made"]
        for e in made[:1]:
            for key in ["MESSAGE", "MESSAGE_ID", "PRIORITY", "VMMBROKER_LEASE", "VMMBROKER_UID", "VMMBROKER_PID",
                        "VMMBROKER_DEVICE", "VMMBROKER_SIZE"]:
                check(key in e, f"the made event has no {key}: {e}")
            check(e.get("VMMBROKER_LEASE") == lease_a and e.get("VMMBROKER_SIZE") == str(64 * MiB)
                  and e.get("PRIORITY") == "6" and len(e.get("MESSAGE_ID", "")) == 32, f"the made event: {e}")
        ids = {}
        for e in events:
            ids.setdefault(e.get("VMMBROKER_EVENT"), set()).add(e.get("MESSAGE_ID"))
        check(all(len(v) == 1 for v in ids.values()) and len({next(iter(v)) for v in ids.values()}) == len(ids),
              f"one MESSAGE_ID per kind of event: {ids}")
        print(f"journal: {len(events)} events, kinds {sorted(set(kinds))}")

    # Not an administrator: PermissionDenied, said by vmmctl with its hint.
    if os.geteuid() == 0:
        os.chmod(os.path.dirname(path), 0o711)
        os.chmod(path, 0o666)
        nobody = pwd.getpwnam("nobody").pw_uid

        def drop():
            os.setgroups([])
            os.setgid(nobody)
            os.setuid(nobody)
        r = metrics(vmmctl, preexec_fn=drop)
        check(r.returncode == 1 and "PermissionDenied" not in r.stdout and "administrator" in r.stderr,
              f"vmmctl metrics as nobody: exit {r.returncode}, {r.stderr!r}")
    else:
        print("not root: the metrics as a user who is no administrator not checked")

    # top: one frame without a terminal, and with --once.
    for args in [["top"], ["top", "--once"]]:
        r = subprocess.run([vmmctl] + args, capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and "DEVICE" in r.stdout and "Largest leases" in r.stdout and "\033" not in r.stdout,
              f"vmmctl {' '.join(args)}: exit {r.returncode}, {r.stdout!r} {r.stderr!r}")
    r = subprocess.run([vmmctl, "status", "--once"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 2, f"vmmctl status --once: exit {r.returncode}, not 2 (a usage error)")

    print(f"{'FAIL' if failures else 'ok'}: {len(fam)} metric families parsed, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
