# SPDX-License-Identifier: MIT
"""The other process of test_vmmbroker.py's sharing and exit tests.

    child.py MODE JSON-ARGUMENTS

Connects to $VMMBROKER_SOCKET, does what MODE says, and prints one JSON object
on stdout (and, for the modes that hold a lease, waits for stdin to close
before going on). Memory is read and written through its device address,
which on the simulated device (tests/simcuda) is a host address of this
process: these tests need it, and CI has no GPU anyway.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys


def report(**kw) -> None:
    print(json.dumps(kw), flush=True)


def err(e) -> dict:
    return {"type": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}


def lease_info(lease) -> dict:
    return {"id": lease.id, "size": lease.size, "device": lease.device, "readonly": lease.readonly,
            "owner": lease.owner, "owner_name": lease.owner_name}


def attach(a: dict) -> None:
    """Attach by token or name, check and write memory, try what the arguments list, free."""
    import vmmbroker
    out: dict = {"uid": os.getuid()}
    with vmmbroker.connect() as c:
        try:
            lease = c.attach(token=a.get("token"), name=a.get("name"), readonly=a.get("readonly", False))
        except vmmbroker.Error as e:
            report(attach=err(e), **out)
            return
        out["lease"] = lease_info(lease)
        n = a.get("check_len", 0)
        if n:
            out["data"] = ctypes.string_at(lease.ptr, n).hex()
        if "write" in a and not lease.readonly:
            off, byte, length = a["write"]
            ctypes.memset(lease.ptr + off, byte, length)
        for what in a.get("try", []):
            try:
                if what == "share":
                    lease.share()
                elif what == "tokens":
                    lease.tokens()
                elif what == "unpublish":
                    c.unpublish(a["unpublish"])
                elif what == "publish":
                    lease.publish("stolen-name")
                elif what == "list-all":
                    c.list(all=True)
                elif what in ("users", "users-all"):
                    out[what] = sorted(u["uid"] for u in c.users(all=what == "users-all"))
                    continue
                elif what == "attach-missing":
                    c.attach(name=a["missing"])
                elif what == "mark":
                    lease.set_reclaimable(0)
                out[what] = "ok"
            except vmmbroker.Error as e:
                out[what] = err(e)
        lease.free()
    report(**out)


def alloc_exit(a: dict) -> None:
    """Lease, wait for stdin to close, and leave without freeing: by os._exit() ("exit"), by being
    killed ("kill"), or by returning ("atexit")."""
    how = a["how"]
    if how == "atexit":
        # Registered before vmmbroker's own handler, so it runs after it (atexit is last in, first out).
        def after():
            import vmmbroker
            ids = [l["id"] for l in vmmbroker.connect().list()]
            report(after_atexit=ids)
        atexit.register(after)
    import vmmbroker
    c = vmmbroker.connect()
    lease = c.alloc(a.get("size", 2 << 20), label="exit-" + how)
    keep = [c, lease]
    if a.get("export"):
        keep.append(lease.__dlpack__())      # a live DLPack export: the lease's free is put off
    report(id=lease.id)
    globals()["keep"] = keep
    sys.stdin.read()                           # until the test has seen the lease (or kills this process)
    if how == "exit":
        os._exit(0)
    # "atexit": return normally, leaving the lease to vmmbroker's atexit handler


def alloc_wait(a: dict) -> None:
    """alloc(size, wait=...) (the call that makes the broker ask for reclaimable leases), then free."""
    import vmmbroker
    with vmmbroker.connect() as c:
        try:
            lease = c.alloc(a["size"], label="waiter", wait=a["wait"])
        except vmmbroker.Error as e:
            report(alloc=err(e))
            return
        report(lease=lease_info(lease))
        lease.free()


def torch_entry(a: dict) -> None:
    """libvmmbroker's PyTorch allocator entry points (pluggable-allocator signatures), through ctypes."""
    import vmmbroker
    from vmmbroker import _lib
    lib = _lib.lib()
    lib.vmmb_torch_alloc.restype = ctypes.c_void_p
    lib.vmmb_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vmmb_torch_free.restype = None
    lib.vmmb_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    size = a["size"]
    ptr = lib.vmmb_torch_alloc(size, 0, None)
    out: dict = {"ptr": ptr or 0}
    c = vmmbroker.connect()
    mine = lambda: [l for l in c.list() if any(h["pid"] == os.getpid() for h in l["holders"])]
    if ptr:
        ctypes.memset(ptr, 0x5A, size)
        out["readback"] = ctypes.string_at(ptr + size - 16, 16).hex()
        out["held_after_alloc"] = sum(l["size"] for l in mine())
        if _lib.has_symbol("vmmb_torch_lease_id"):
            buf = ctypes.create_string_buffer(_lib.TOKEN_SIZE)
            lib.vmmb_torch_lease_id.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            n = lib.vmmb_torch_lease_id(ctypes.c_void_p(ptr + 4096), buf, len(buf))
            out["lease_id"] = buf.value.decode() if n > 0 else n
            out["labels"] = {l["id"]: l.get("label") for l in mine()}
        lib.vmmb_torch_free(ptr, size, 0, None)
    if _lib.has_symbol("vmmb_torch_release_all"):
        lib.vmmb_torch_release_all.argtypes = []
        lib.vmmb_torch_release_all.restype = ctypes.c_int
        out["release_all"] = lib.vmmb_torch_release_all()
        out["held_after_release"] = sum(l["size"] for l in mine())
    report(**out)


if __name__ == "__main__":
    mode, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    {"attach": attach, "alloc-exit": alloc_exit, "alloc-wait": alloc_wait, "torch": torch_entry}[mode](args)
