#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the seed corpus of tests/fuzz/fuzz-daemon into tests/fuzz/corpus/ (or the directory given).

Each input is a 4-byte header (flags, then three cut points) and the bytes the
client sends; fuzz-daemon.c describes the format. Run it again after changing
the seeds here and commit the result:  tests/fuzz/make-corpus.py
"""

import json
import os
import sys

SESSION, FD_FIRST, FD_LATER, SILENCE, NO_READ, ADMIN, CROWD = 1, 2, 4, 8, 16, 32, 64
MiB = 1 << 20


def call(method, params=None, **extra):
    """One varlink call, NUL-terminated."""
    if "." not in method:
        method = "io.vmmbroker." + method
    msg = {"method": method}
    if params is not None:
        msg["parameters"] = params
    msg.update(extra)
    return json.dumps(msg, separators=(",", ":")).encode() + b"\0"


def raw(text):
    return text.encode() if isinstance(text, str) else text


SEEDS = {}


def seed(name, payload, flags=0, cuts=(0, 0, 0)):
    assert name not in SEEDS, name
    SEEDS[name] = bytes([flags, *cuts]) + payload


# --- every method, once, on its own ------------------------------------------------------------------
seed("alloc", call("Alloc", {"size": 2 * MiB}))
seed("alloc-device-label", call("Alloc", {"size": 3 * MiB, "device": 1, "label": "fuzz seed"}))
seed("alloc-any-device", call("Alloc", {"size": 1, "device": -1}))
seed("alloc-wait", call("Alloc", {"size": 2 * MiB, "wait_usec": 1000}) + call("Alloc", {"size": 1 << 40, "wait_usec": 1 << 62})
     + call("Alloc", {"size": 1, "wait_usec": -1}) + call("Alloc", {"size": 1, "wait_usec": "1"}) + call("Status"))
seed("alloc-devices", call("Alloc", {"size": 2 * MiB, "devices": [0, 1, 1]}) + call("Alloc", {"size": 1, "devices": []})
     + call("Alloc", {"size": 1, "devices": [7]}) + call("Alloc", {"size": 1, "devices": [-1]})
     + call("Alloc", {"size": 1, "devices": list(range(65))}) + call("Alloc", {"size": 1, "device": 0, "devices": [0]})
     + call("Alloc", {"size": 1, "devices": [1 << 40, "0"]}) + call("Alloc", {"size": 1, "devices": 3})
     + call("Alloc", {"size": 2 * MiB, "devices": [0], "wait_usec": 1000}) + call("Status"))
seed("alloc-no-such-device", call("Alloc", {"size": 1, "device": 7}) + call("Alloc", {"size": 1, "device": 2147483648})
     + call("Alloc", {"size": 1, "device": -2}))
seed("free", call("Free", {"id": "0123456789abcdef0123456789abcdef"}))
seed("share", call("Share", {"id": "0123456789abcdef0123456789abcdef", "uid": 1000, "readonly": True}))
seed("revoke", call("Revoke", {"token": "fedcba9876543210fedcba9876543210"}))
seed("attach-token", call("Attach", {"token": "fedcba9876543210fedcba9876543210", "readonly": True}))
seed("attach-name", call("Attach", {"name": "fuzz.shared"}))
seed("publish", call("Publish", {"id": "0123456789abcdef0123456789abcdef", "name": "fuzz.shared",
                                 "uids": [0, 1000, 4294967294], "readonly": False}))
seed("publish-slash", call("Publish", {"id": "0123456789abcdef0123456789abcdef", "name": "fuzz/shared"}))
seed("unpublish", call("Unpublish", {"name": "fuzz.shared"}))
seed("tokens", call("Tokens", {"id": "0123456789abcdef0123456789abcdef"}))
seed("tokens-admin", call("Tokens", {"id": "0123456789abcdef0123456789abcdef"}), flags=ADMIN)
seed("set-reclaimable", call("SetReclaimable", {"id": "0123456789abcdef0123456789abcdef", "priority": 3})
     + call("SetReclaimable", {"id": "0123456789abcdef0123456789abcdef"})
     + call("SetReclaimable", {"id": "x", "priority": 2147483648}) + call("SetReclaimable", {"id": "x", "priority": -1}))
seed("park-unpark", call("Park", {"id": "0123456789abcdef0123456789abcdef"})
     + call("Unpark", {"id": "0123456789abcdef0123456789abcdef"}) + call("Park", {}) + call("Unpark", {"id": 7})
     + call("Park", {"id": "x", "keep": True}))
seed("free-keep", call("Free", {"id": "0123456789abcdef0123456789abcdef", "keep": True})
     + call("Free", {"id": "x", "keep": "yes"}) + call("Free", {"id": "x", "keep": None}))
seed("metrics", call("Metrics") + call("Metrics", {"x": 1}))
seed("metrics-admin", call("Metrics"), flags=ADMIN)
seed("watch-reclaim", call("WatchReclaim", more=True) + call("Status"))
seed("watch-reclaim-no-more", call("WatchReclaim") + call("WatchReclaim", {"x": 1}, more=True)
     + call("WatchReclaim", more=True, oneway=True))

# Attach's and Unpublish's NAME or OWNER/NAME: OWNER a user name or uid, malformed ones, names stored before
# owner namespaces (with '/' in NAME), an OWNER at and past the longest user name.
OWNER_NAMES = ["root/fuzz.shared", "0/fuzz.shared", "65534/fuzz.shared", "4294967295/x", "4294967296/x",
               "99999999999999999999/x", "no-such-user/x", "root/legacy/with/slashes", "/x", "a/", "a//b",
               "root/-dash", "o" * 64 + "/x", "o" * 65 + "/x", "root/" + "n" * 128, "root/" + "n" * 129, "1a/x"]
seed("attach-owner-name", b"".join(call("Attach", {"name": n}) for n in OWNER_NAMES))
seed("unpublish-owner-name", b"".join(call("Unpublish", {"name": n}) for n in OWNER_NAMES))
seed("unpublish-owner-name-admin", b"".join(call("Unpublish", {"name": n}) for n in OWNER_NAMES), flags=ADMIN)
seed("list", call("List", {}))
seed("list-all", call("List", {"all": True}))
seed("list-all-admin", call("List", {"all": True}), flags=ADMIN)
seed("users", call("Users", {}))
seed("users-all", call("Users", {"all": True}))
seed("users-all-admin", call("Users", {"all": True}), flags=ADMIN)
seed("status", call("Status"))
seed("getinfo", call("org.varlink.service.GetInfo", {}))
seed("getinterfacedescription", call("org.varlink.service.GetInterfaceDescription", {"interface": "io.vmmbroker"}))
seed("getinterfacedescription-service",
     call("org.varlink.service.GetInterfaceDescription", {"interface": "org.varlink.service"}))
seed("getinterfacedescription-unknown",
     call("org.varlink.service.GetInterfaceDescription", {"interface": "com.example.nothing"}))

# --- sessions: each call answered before the next, $L0/$T0 the last lease and token -------------------
seed("session-alloc-free", call("Alloc", {"size": 5 * MiB, "label": "one"}) + call("Free", {"id": "$L0"})
     + call("Free", {"id": "$L0"}), flags=SESSION)
seed("session-reclaim", call("Alloc", {"size": 2 * MiB}) + call("SetReclaimable", {"id": "$L0", "priority": 0})
     + call("SetReclaimable", {"id": "$L0", "priority": 7}) + call("SetReclaimable", {"id": "$L0"})
     + call("SetReclaimable", {"id": "$L0", "priority": 1}) + call("Alloc", {"size": 2 * MiB, "wait_usec": 1000})
     + call("Free", {"id": "$L0"}) + call("WatchReclaim", more=True) + call("List"), flags=SESSION)
seed("session-park",
     call("Alloc", {"size": 4 * MiB}) + call("Park", {"id": "$L0"}) + call("Park", {"id": "$L0"}) + call("List", {})
     + call("Status") + call("Users", {}) + call("Unpark", {"id": "$L0"}) + call("Unpark", {"id": "$L0"})
     + call("Park", {"id": "$L0"}) + call("Free", {"id": "$L0"}) + call("Unpark", {"id": "$L0"}), flags=SESSION)
seed("session-park-shared",
     call("Alloc", {"size": 6 * MiB, "device": 1}) + call("Share", {"id": "$L0"}) + call("Park", {"id": "$L0"})
     + call("Attach", {"token": "$T0"}) + call("Park", {"id": "$L0"}) + call("Park", {"id": "$L1"})
     + call("Unpark", {"id": "$L1"}) + call("Publish", {"id": "$L0", "name": "fuzz.parked"})
     + call("Park", {"id": "$L0"}) + call("Attach", {"name": "fuzz.parked", "readonly": True})
     + call("Free", {"id": "$L0"}) + call("List", {"all": True}), flags=SESSION)
seed("session-park-over-limits",
     call("Alloc", {"size": 8 * MiB}) + call("Alloc", {"size": 8 * MiB}) + call("Alloc", {"size": 8 * MiB})
     + call("Park", {"id": "$L0"}) + call("Park", {"id": "$L1"}) + call("Park", {"id": "$L2"})
     + call("Alloc", {"size": 16 * MiB}) + call("Unpark", {"id": "$L0"}) + call("Unpark", {"id": "$L1"})
     + call("Unpark", {"id": "$L2"}) + call("Status"), flags=SESSION)
seed("session-keep",
     call("Alloc", {"size": 2 * MiB}) + call("Free", {"id": "$L0", "keep": True}) + call("List", {})
     + call("Alloc", {"size": 2 * MiB}) + call("Free", {"id": "$L0", "keep": True})
     + call("Alloc", {"size": 4 * MiB}) + call("Alloc", {"size": 2 * MiB, "wait_usec": 1000})
     + call("Free", {"id": "$L0", "keep": False}) + call("Free", {"id": "$L1", "keep": True}) + call("Status"),
     flags=SESSION)
seed("session-keep-shared",      # kept while shared, asked back by size, another size, with devices
     call("Alloc", {"size": 8 * MiB}) + call("Share", {"id": "$L0"}) + call("Free", {"id": "$L0", "keep": True})
     + call("Share", {"id": "$L0"}) + call("Attach", {"token": "$T0"}) + call("List", {}) + call("Status")
     + call("Alloc", {"size": 8 * MiB}) + call("Free", {"id": "$L0", "keep": True})
     + call("Alloc", {"size": 4 * MiB}) + call("Free", {"id": "$L1", "keep": True}) + call("Free", {"id": "$L1"})
     + call("Alloc", {"size": 8 * MiB, "devices": [0]}), flags=SESSION)
seed("session-keep-refused",
     call("Alloc", {"size": 2 * MiB}) + call("Share", {"id": "$L0"}) + call("Free", {"id": "$L0", "keep": True})
     + call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "fuzz.kept"})
     + call("Free", {"id": "$L0", "keep": True}) + call("Alloc", {"size": 2 * MiB}) + call("Park", {"id": "$L0"})
     + call("Free", {"id": "$L0", "keep": True}) + call("SetReclaimable", {"id": "$L0", "priority": 1}), flags=SESSION)
seed("session-share-attach-revoke",
     call("Alloc", {"size": 2 * MiB}) + call("Share", {"id": "$L0"}) + call("Attach", {"token": "$T0"})
     + call("List", {}) + call("Revoke", {"token": "$T0"}) + call("Attach", {"token": "$T0"})
     + call("Free", {"id": "$L0"}) + call("Free", {"id": "$L1"}), flags=SESSION)
seed("session-share-readonly",
     call("Alloc", {"size": 4 * MiB, "device": 1}) + call("Share", {"id": "$L0", "readonly": True, "uid": 0})
     + call("Attach", {"token": "$T0", "readonly": True}) + call("Share", {"id": "$L0"}), flags=SESSION)
seed("session-publish",
     call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "fuzz.pub", "uids": [1000]})
     + call("Publish", {"id": "$L0", "name": "fuzz.pub", "readonly": True})
     + call("Publish", {"id": "$L0", "name": "other"}) + call("Free", {"id": "$L0"})
     + call("Attach", {"name": "fuzz.pub"}) + call("List", {"all": True}) + call("Unpublish", {"name": "fuzz.pub"})
     + call("Status"), flags=SESSION | ADMIN)
seed("session-token-for-another-uid",
     call("Alloc", {"size": 2 * MiB}) + call("Share", {"id": "$L0", "uid": 4242}) + call("Attach", {"token": "$T0"})
     + call("Revoke", {"token": "$T0"}), flags=SESSION)
seed("session-tokens-list",
     call("Alloc", {"size": 2 * MiB}) + call("Tokens", {"id": "$L0"}) + call("Share", {"id": "$L0"})
     + call("Share", {"id": "$L0", "uid": 65534, "readonly": True}) + call("Tokens", {"id": "$L0"})
     + call("Revoke", {"token": "$T1"}) + call("Tokens", {"id": "$L0"}) + call("Attach", {"token": "$T0"})
     + call("Tokens", {"id": "$L0"}) + call("Free", {"id": "$L0"}) + call("Free", {"id": "$L0"})
     + call("Tokens", {"id": "$L0"}) + call("Tokens", {"id": "no-such-lease"}), flags=SESSION)
seed("session-tokens-admin",
     call("Alloc", {"size": 2 * MiB}) + call("Share", {"id": "$L0"}) + call("Free", {"id": "$L0"})
     + call("Tokens", {"id": "$L0"}) + call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "t"})
     + call("Share", {"id": "$L0"}) + call("Free", {"id": "$L0"}) + call("Tokens", {"id": "$L0"}),
     flags=SESSION | ADMIN)
seed("session-owner-names",
     call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "fuzz.own"})
     + call("Attach", {"name": "root/fuzz.own"}) + call("Attach", {"name": "0/fuzz.own"})
     + call("Attach", {"name": "65534/fuzz.own"}) + call("Publish", {"id": "$L0", "name": "fuzz/own"})
     + call("Unpublish", {"name": "65534/fuzz.own"}) + call("Unpublish", {"name": "0/fuzz.own"})
     + call("Unpublish", {"name": "root/fuzz.own"}) + call("Unpublish", {"name": "fuzz.own"})
     + call("List", {}), flags=SESSION)
seed("session-name-in-use",
     call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "taken"})
     + call("Alloc", {"size": 2 * MiB}) + call("Publish", {"id": "$L0", "name": "taken"}), flags=SESSION)
seed("session-max-leases", call("Alloc", {"size": 2 * MiB}) * 9 + call("Users", {}), flags=SESSION)
seed("session-max-bytes", call("Alloc", {"size": 16 * MiB}) + call("Alloc", {"size": 16 * MiB})
     + call("Alloc", {"size": 64 * MiB}) + call("Users", {"all": True}), flags=SESSION | ADMIN)
seed("session-tokens", call("Alloc", {"size": 2 * MiB}) + call("Share", {"id": "$L0"}) * 65, flags=SESSION)
seed("session-reuse-cache", (call("Alloc", {"size": 8 * MiB}) + call("Free", {"id": "$L0"})) * 4
     + call("Alloc", {"size": 24 * MiB}), flags=SESSION)
seed("session-oneway", call("Alloc", {"size": 2 * MiB}, oneway=True) + call("List", {})
     + call("Free", {"id": "$L0"}, oneway=True), flags=SESSION)

# --- pipelining, cuts and odd clients ---------------------------------------------------------------------
every = (call("Status") + call("List", {}) + call("Users", {}) + call("Alloc", {"size": 2 * MiB})
         + call("org.varlink.service.GetInfo") + call("Free", {"id": "x"}))
seed("pipelined", every)
seed("pipelined-cut", every, cuts=(1, 77, 200))
seed("pipelined-no-read", call("org.varlink.service.GetInterfaceDescription", {"interface": "io.vmmbroker"}) * 40,
     flags=NO_READ)
seed("oneway", call("Status", oneway=True) + call("Alloc", {"size": 2 * MiB}, oneway=True))
seed("more", call("List", {}, more=True))
seed("crowd", call("Status") + call("List", {}), flags=CROWD)
seed("crowd-silent", b"", flags=CROWD | SILENCE)
seed("crowd-session", call("Alloc", {"size": 2 * MiB}) + call("Free", {"id": "$L0"}), flags=CROWD | SESSION)
seed("fd-first", call("Status"), flags=FD_FIRST)
seed("fd-later", every, flags=FD_LATER, cuts=(128, 0, 0))
seed("fd-mid-message", call("Status") + call("List"), flags=FD_LATER, cuts=(40, 0, 0))
seed("half-message-silence", raw('{"method":"io.vmmbroker.Status","param'), flags=SILENCE)
seed("half-message-eof", raw('{"method":"io.vmmbroker.Status"'))
seed("reply-then-silence", call("Status") + raw('{"meth'), flags=SILENCE | NO_READ)

# --- bad input ---------------------------------------------------------------------------------------------
seed("empty-message", b"\0")
seed("not-an-object", raw('[1,2,3]\0"string"\0'))
seed("bad-json", raw('{"method":"io.vmmbroker.Status",}\0'))
seed("bad-utf8-label", raw('{"method":"io.vmmbroker.Alloc","parameters":{"size":1,"label":"\xff\xfe\xc3"}}\0'
                           .encode("latin-1")))
seed("bad-utf8-method", b'{"method":"io.vmmbroker.St\xc3\x28tus"}\0')
seed("surrogate-escape", raw('{"method":"io.vmmbroker.Alloc","parameters":{"size":1,"label":"\\ud800"}}\0'))
seed("control-in-label", raw('{"method":"io.vmmbroker.Alloc","parameters":{"size":1,"label":"a\\u0001b"}}\0'))
seed("duplicate-key", raw('{"method":"io.vmmbroker.Status","method":"io.vmmbroker.List"}\0'))
seed("unknown-key", raw('{"method":"io.vmmbroker.Status","parameters":{},"extra":1}\0'))
seed("unknown-parameter", call("Alloc", {"size": 1, "colour": "red"}))
seed("wrong-types", call("Alloc", {"size": "1G"}) + call("Alloc", {"size": -1}) + call("Alloc", {"size": 1.5})
     + call("Alloc", {"size": 18446744073709551615}) + call("Alloc", {"size": 0}) + call("Free", {"id": 7})
     + call("Share", {"id": "x", "uid": 4294967295}) + call("Publish", {"id": "x", "name": "-bad", "uids": [-1]})
     + call("Publish", {"id": "x", "name": "n", "uids": [4294967295]})
     + call("Attach", {"token": "x", "name": "y"}) + call("Attach", {}) + call("Tokens", {"id": 7})
     + call("Tokens", {}) + call("Tokens", {"id": "x" * 65}) + call("Attach", {"name": 7})
     + call("Unpublish", {"name": "x" * 300}))
seed("unknown-parameter-every-method",
     b"".join(call(m, {"bogus": 1}) for m in ("Alloc", "Free", "Share", "Revoke", "Attach", "Publish", "Unpublish",
                                             "Tokens", "List", "Users", "Status", "Park", "Unpark", "Metrics",
                                             "SetReclaimable", "WatchReclaim", "org.varlink.service.GetInfo",
                                             "org.varlink.service.GetInterfaceDescription"))
     + call("List", {"all": 1}) + call("Users", {"all": "yes"}) + call("org.varlink.service.GetInterfaceDescription"))
seed("unknown-method", call("io.vmmbroker.Nothing") + call("com.example.Other.Call"))
seed("invalid-method-name", raw('{"method":"NoDots"}\0{"method":"a..b"}\0{"method":".a.b"}\0{"method":""}\0'))
seed("parameters-not-object", raw('{"method":"io.vmmbroker.Status","parameters":[]}\0'))
seed("deep-nesting-16", raw('{"method":"io.vmmbroker.Status","parameters":{"a":' + "[" * 14 + "]" * 14 + "}}\0"))
seed("deep-nesting-17", raw('{"method":"io.vmmbroker.Status","parameters":{"a":' + "[" * 15 + "]" * 15 + "}}\0"))
seed("deep-nesting-1000", raw("[" * 1000 + "]" * 1000 + "\0"))
seed("long-label", call("Alloc", {"size": 1, "label": "x" * 200}))
seed("oversize-message", raw('{"method":"io.vmmbroker.Alloc","parameters":{"size":1,"label":"' + "y" * 70000 + '"}}\0'))
seed("oversize-no-nul", raw("z" * 66000))
seed("just-under-limit", raw('{"method":"io.vmmbroker.Status","parameters":{},"x":"' + "w" * (65536 - 60) + '"}\0'))
seed("garbage", bytes(range(256)) * 4)
seed("numbers", raw('{"method":"io.vmmbroker.Alloc","parameters":{"size":1e400}}\0'
                    '{"method":"io.vmmbroker.Alloc","parameters":{"size":00}}\0'
                    '{"method":"io.vmmbroker.Alloc","parameters":{"size":-0}}\0'))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        os.unlink(os.path.join(out, old))
    for name, data in sorted(SEEDS.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} seeds in {out}")


if __name__ == "__main__":
    main()
