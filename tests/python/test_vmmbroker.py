# SPDX-License-Identifier: MIT
"""The vmmbroker Python package against the real daemon on the simulated device.

Run by `meson test python` with $VMMBROKER_DAEMON, $VMMBROKER_LIBRARY,
$VMMBROKER_LIBCUDA and $PYTHONPATH set (tests/python/meson.build). The test
starts its own daemon (broker.py); the other processes of the sharing and exit
tests are child.py, as another user (nobody) when the test runs as root.
On the simulated device a lease's device address is a host address of the
process that mapped it, so the tests read and write leased memory with ctypes.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import pwd
import signal
import subprocess
import tempfile
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vmmbroker                                    # noqa: E402
from vmmbroker import _dlpack, _lib, _varlink       # noqa: E402
from broker import Broker                           # noqa: E402

MiB = 1 << 20
CHILD_TIMEOUT_S = 60
NOBODY = 65534
# The one daemon of this file: per-user limits low enough to go over, high enough for every other test.
CONFIG = "[Limits]\nMaxBytes=1G\nMaxLeases=64\n"

broker: Broker


def setUpModule() -> None:
    global broker
    broker = Broker(CONFIG)
    os.environ["VMMBROKER_SOCKET"] = broker.socket
    os.environ["VMMBROKER_RECONNECT_TIMEOUT"] = "5"


def tearDownModule() -> None:
    gc.collect()
    status = broker.stop()
    if status not in (0, None):
        raise AssertionError(f"vmmbrokerd exited with {status}:\n{broker.log()}")


def listed(all: bool = True) -> dict[str, dict]:
    with vmmbroker.connect() as c:
        return {l["id"]: l for l in c.list(all=all)}


def others_can_run(path: str) -> bool:
    """Whether a user other than the file's owner may run `path` (every directory above it searchable)."""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & 0o001:
        return False
    d = os.path.dirname(path)
    while True:
        if not os.stat(d).st_mode & 0o001:
            return False
        if d == "/":
            return True
        d = os.path.dirname(d)


def other_uid() -> int:
    """The user the child processes run as: nobody when root (and nobody may run this Python: not one
    under /root, such as pyenv's), else the caller's own."""
    return NOBODY if os.getuid() == 0 and others_can_run(sys.executable) else os.getuid()


def run_child(mode: str, args: dict, as_other: bool = True, **popen) -> subprocess.Popen:
    kw: dict = {}
    if as_other and other_uid() != os.getuid():
        kw = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    return subprocess.Popen([sys.executable, os.path.join(HERE, "child.py"), mode, json.dumps(args)],
                            stdout=subprocess.PIPE, text=True, **kw, **popen)


def child_result(mode: str, args: dict, as_other: bool = True) -> dict:
    p = run_child(mode, args, as_other)
    out, _ = p.communicate(timeout=CHILD_TIMEOUT_S)
    assert p.returncode == 0, f"child.py {mode} exited with {p.returncode}: {out}"
    return json.loads(out.strip().splitlines()[-1])


class ClientTestCase(unittest.TestCase):
    def setUp(self) -> None:
        self.client = vmmbroker.connect()

    def tearDown(self) -> None:
        self.client.close()


class TestLeases(ClientTestCase):
    def test_alloc_properties(self) -> None:
        with self.client.alloc(3 * MiB, label="py-props") as lease:
            self.assertIsInstance(lease, vmmbroker.Lease)
            self.assertEqual(lease.size, 4 * MiB)          # rounded up to the 2 MiB granularity
            self.assertEqual(lease.device, 0)
            self.assertFalse(lease.readonly)
            self.assertEqual(lease.owner, os.getuid())
            self.assertEqual(lease.owner_name, pwd.getpwuid(os.getuid()).pw_name)
            self.assertRegex(lease.id, r"^[0-9a-f]+$")
            self.assertNotEqual(lease.ptr, 0)
            self.assertEqual(ctypes.string_at(lease.ptr, lease.size), bytes(lease.size))  # reads zero
            info = listed()[lease.id]
            self.assertEqual(info["size"], lease.size)
            self.assertEqual(info["label"], "py-props")
            self.assertEqual([h["pid"] for h in info["holders"]], [os.getpid()])
            self.assertIn(lease.id, repr(lease))

    def test_alloc_device(self) -> None:
        with self.client.alloc(MiB, device=0) as lease:
            self.assertEqual(lease.device, 0)
        with self.assertRaises(vmmbroker.Error) as cm:
            self.client.alloc(MiB, device=7)
        self.assertEqual(cm.exception.errno, errno.ENODEV)

    def test_alloc_devices(self) -> None:
        with self.client.alloc(MiB, devices=[0, 0]) as lease:       # placed among a set (vmmb_alloc_among())
            self.assertEqual(lease.device, 0)
        for devices, code in (([0, 7], errno.ENODEV), ([-1], errno.ENODEV), (list(range(65)), errno.EINVAL)):
            with self.assertRaises(vmmbroker.Error) as cm:
                self.client.alloc(MiB, devices=devices)
            self.assertEqual(cm.exception.errno, code, devices)
        with self.assertRaises(vmmbroker.Error) as cm:
            self.client.alloc(MiB, device=0, devices=[0])
        self.assertEqual(cm.exception.errno, errno.EINVAL)

    def test_free_is_idempotent(self) -> None:
        lease = self.client.alloc(MiB)
        lid = lease.id
        self.assertIn(lid, listed())
        lease.free()
        self.assertTrue(lease.freed)
        self.assertNotIn(lid, listed())
        lease.free()
        self.assertEqual(lease.id, lid)                      # what it was stays readable
        with self.assertRaises(ValueError):
            lease.ptr
        with self.assertRaises(ValueError):
            lease.share()

    def test_context_managers(self) -> None:
        with vmmbroker.connect() as c:
            with c.alloc(MiB) as inner:
                lid = inner.id
                self.assertIn(lid, listed())
            self.assertNotIn(lid, listed())
            kept = c.alloc(MiB)                             # freed by the client's close
            kept_id = kept.id
        self.assertTrue(c.closed)
        self.assertTrue(kept.freed)
        self.assertNotIn(kept_id, listed())
        with self.assertRaises(ValueError):
            c.alloc(MiB)
        c.close()                                           # twice is harmless

    def test_free_after_a_stream(self) -> None:
        if not _lib.has_symbol("vmmb_free_stream"):
            self.skipTest("libvmmbroker has no vmmb_free_stream yet")
        for stream in (0, 1):                                 # the legacy default stream, both ways
            lease = self.client.alloc(MiB)
            lid = lease.id
            lease.free(stream=stream)
            self.assertNotIn(lid, listed())
        with self.assertRaises(TypeError):
            self.client.alloc(MiB).free(stream="default")  # type: ignore[arg-type]

    def test_garbage_collection_frees(self) -> None:
        lease = self.client.alloc(MiB)
        lid = lease.id
        del lease
        gc.collect()
        self.assertNotIn(lid, listed())

    def test_status(self) -> None:
        before = self.client.status()
        self.assertEqual(len(before), 1)
        dev = before[0]
        for key in ("index", "name", "total", "granularity", "capacity", "leased", "scrubbing", "cached",
                    "leases"):
            self.assertIn(key, dev)
        self.assertEqual(dev["index"], 0)
        self.assertEqual(dev["granularity"], 2 * MiB)
        with self.client.alloc(8 * MiB):
            self.assertEqual(self.client.status()[0]["leased"], dev["leased"] + 8 * MiB)

    def test_list_own(self) -> None:
        with self.client.alloc(MiB, label="mine") as lease:
            mine = {l["id"]: l for l in self.client.list()}
            self.assertEqual(mine[lease.id]["uid"], os.getuid())
            self.assertEqual(mine[lease.id]["pid"], os.getpid())

    def test_users_own(self) -> None:
        def mine() -> dict:
            us = self.client.users()
            self.assertEqual([u["uid"] for u in us], [os.getuid()])
            return us[0]

        def on(user: dict, device: int) -> dict:
            return {d["index"]: d for d in user["devices"]}[device]

        gc.collect()                        # no lease of an earlier test left for a collection to free meanwhile
        before = mine()
        with self.client.alloc(3 * MiB) as lease:
            during = mine()
            self.assertEqual(during["leases"], before["leases"] + 1)
            self.assertEqual(on(during, lease.device)["bytes"], on(before, lease.device)["bytes"] + lease.size)
            self.assertGreaterEqual(on(during, lease.device)["max_bytes"], on(during, lease.device)["bytes"])
            self.assertGreaterEqual(during["max_leases"], during["leases"])
            self.assertGreaterEqual(during["connections"], 1)
            if os.getuid() == 0:            # an administrator: every user, this one among them
                self.assertIn(os.getuid(), [u["uid"] for u in self.client.users(all=True)])
        after = mine()
        self.assertEqual(after["leases"], before["leases"])
        self.assertEqual(on(after, lease.device)["bytes"], on(before, lease.device)["bytes"])

    def test_threads(self) -> None:
        results: list = []

        def work() -> None:
            for _ in range(5):
                with self.client.alloc(MiB) as lease:
                    results.append(lease.size)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CHILD_TIMEOUT_S)
        self.assertEqual(results, [2 * MiB] * 20)


class TestErrors(ClientTestCase):
    def assertError(self, cm, cls, number: int) -> None:
        e = cm.exception
        self.assertIs(type(e), cls)
        self.assertIsInstance(e, vmmbroker.Error)
        self.assertIsInstance(e, OSError)
        self.assertEqual(e.errno, number)
        self.assertTrue(e.strerror and e.strerror != os.strerror(number), "no sentence of the broker's")
        self.assertEqual(e.message, e.strerror)
        self.assertIn(e.strerror, str(e))

    def test_not_the_library(self) -> None:
        """A library without a function the package declares (older, or not libvmmbroker at all: here the
        simulated driver) is refused at the first call with ImportError naming the function and the fix."""
        code = ("import vmmbroker\n"
                "try:\n"
                "    vmmbroker.connect()\n"
                "except ImportError as e:\n"
                "    print('ImportError:', e)\n")
        env = dict(os.environ, VMMBROKER_LIBRARY=os.environ["VMMBROKER_LIBCUDA"])
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("ImportError: vmmbroker: libvmmbroker", out.stdout)
        self.assertIn("has no vmmb_connect()", out.stdout)
        self.assertIn("$VMMBROKER_LIBRARY", out.stdout)

    def test_size_zero(self) -> None:
        with self.assertRaises(vmmbroker.Error) as cm:
            self.client.alloc(0)
        self.assertError(cm, vmmbroker.Error, errno.EINVAL)
        self.assertIn("0 bytes", cm.exception.strerror)

    def test_bad_arguments(self) -> None:
        with self.assertRaises(TypeError):
            self.client.alloc("1M")  # type: ignore[arg-type]
        with self.assertRaises(vmmbroker.Error) as cm:
            self.client.alloc(-1)
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        with self.assertRaises(ValueError):
            self.client.attach()
        with self.assertRaises(ValueError):
            self.client.attach(token="0" * 32, name="x")

    def test_over_a_limit(self) -> None:
        with self.assertRaises(vmmbroker.QuotaExceeded) as cm:
            self.client.alloc(2 << 30)                       # MaxBytes=1G
        self.assertError(cm, vmmbroker.QuotaExceeded, errno.EDQUOT)

    def test_alloc_wait(self) -> None:
        # Room now: served at once, as without wait.
        with self.client.alloc(MiB, wait=5.0) as lease:
            self.assertEqual(lease.size, 2 * MiB)
        # Never servable (over MaxBytes=1G): fails at once, not after the wait.
        with self.assertRaises(vmmbroker.QuotaExceeded) as cm:
            self.client.alloc(2 << 30, wait=600.0)
        self.assertError(cm, vmmbroker.QuotaExceeded, errno.EDQUOT)
        for bad in (-1, "1", True, float("nan")):
            with self.assertRaises(vmmbroker.Error) as cm:
                self.client.alloc(MiB, wait=bad)               # type: ignore[arg-type]
            self.assertEqual(cm.exception.errno, errno.EINVAL)
        self.assertEqual(self.client.status()[0]["waiters"], 0)

    def test_attach_bad_name(self) -> None:
        with self.assertRaises(vmmbroker.NotFound) as cm:
            self.client.attach(name="no-such-name")
        self.assertError(cm, vmmbroker.NotFound, errno.ENOENT)
        self.assertIn("no-such-name", cm.exception.strerror)
        with self.assertRaises(vmmbroker.NotFound) as cm:
            self.client.attach(name="root/no-such-name")
        self.assertEqual(cm.exception.errno, errno.ENOENT)
        with self.assertRaises(vmmbroker.Error) as cm:
            self.client.attach(name="")
        self.assertEqual(cm.exception.errno, errno.EINVAL)

    def test_attach_bad_token(self) -> None:
        with self.assertRaises(vmmbroker.NotFound) as cm:
            self.client.attach(token="0" * 32)
        self.assertError(cm, vmmbroker.NotFound, errno.ENOKEY)
        with self.assertRaises(vmmbroker.NotFound) as cm:
            self.client.revoke("0" * 32)
        self.assertEqual(cm.exception.errno, errno.ENOKEY)

    def test_unpublish_unknown(self) -> None:
        with self.assertRaises(vmmbroker.NotFound) as cm:
            self.client.unpublish("never-published")
        self.assertError(cm, vmmbroker.NotFound, errno.ENOENT)

    def test_publish_errors(self) -> None:
        with self.client.alloc(MiB) as a, self.client.alloc(MiB) as b:
            with self.assertRaises(vmmbroker.Error) as cm:
                a.publish("with/slash")
            self.assertEqual(cm.exception.errno, errno.EINVAL)
            a.publish("py-taken")
            try:
                with self.assertRaises(vmmbroker.Error) as cm:
                    b.publish("py-taken")
                self.assertEqual(cm.exception.errno, errno.EEXIST)
            finally:
                self.client.unpublish("py-taken")

    def test_no_broker(self) -> None:
        missing = os.path.join(broker.dir, "nobody-listens")
        with self.assertRaises(vmmbroker.Error) as cm:
            vmmbroker.connect(missing)
        self.assertIn(cm.exception.errno, (errno.ENOENT, errno.ECONNREFUSED))
        self.assertIn(missing, cm.exception.strerror)
        with self.assertRaises(vmmbroker.Error) as cm:
            vmmbroker.connect("")
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        # Status and List speak varlink themselves: the same errors.
        with self.assertRaises(vmmbroker.Error) as cm:
            _varlink.call(missing, "Status")
        self.assertIn(cm.exception.errno, (errno.ENOENT, errno.ECONNREFUSED))
        self.assertIn(missing, cm.exception.strerror)
        # And the broker's own errors, mapped as libvmmbroker maps them.
        with self.assertRaises(vmmbroker.Error) as cm:
            _varlink.call(broker.socket, "NoSuchMethod")
        self.assertEqual(cm.exception.errno, errno.EOPNOTSUPP)

    def test_every_error_mapped(self) -> None:
        """Every error of the interface has its errno in the package's own varlink calls (proto/codec.c's
        table), not EPROTO."""
        idl = os.path.join(HERE, "..", "..", "proto", "io.vmmbroker.varlink")
        with open(idl) as f:
            names = [line.split()[1] for line in f if line.startswith("error ")]
        self.assertGreater(len(names), 10)
        for name in names:
            self.assertIn("io.vmmbroker." + name, _varlink._ERRNO, name)
        self.assertEqual(_varlink._ERRNO["io.vmmbroker.OutOfHostMemory"], errno.ENOSPC)


class TestArrayInterface(ClientTestCase):
    def test_lease_interface(self) -> None:
        with self.client.alloc(MiB) as lease:
            self.assertEqual(lease.__cuda_array_interface__, {
                "shape": (2 * MiB,),
                "typestr": "|u1",
                "data": (lease.ptr, False),
                "strides": None,
                "stream": None,                # CAI v3: None means no synchronization is needed
                "version": 3,
            })

    def test_view(self) -> None:
        with self.client.alloc(MiB) as lease:
            v = lease.view("float32", (4, 8), offset=256)
            self.assertIsInstance(v, vmmbroker.LeaseView)
            self.assertEqual((v.dtype, v.shape, v.offset, v.nbytes, v.itemsize), ("float32", (4, 8), 256, 128, 4))
            self.assertEqual(v.ptr, lease.ptr + 256)
            self.assertIs(v.lease, lease)
            self.assertEqual(v.__cuda_array_interface__, {
                "shape": (4, 8), "typestr": "<f4", "data": (lease.ptr + 256, False),
                "strides": None, "stream": None, "version": 3})
            self.assertEqual(lease.view("int64", 10).shape, (10,))
            for name, typestr in [("bool", "|b1"), ("int8", "|i1"), ("int16", "<i2"), ("int32", "<i4"),
                                  ("int64", "<i8"), ("uint8", "|u1"), ("uint16", "<u2"), ("uint32", "<u4"),
                                  ("uint64", "<u8"), ("float16", "<f2"), ("bfloat16", "<V2"),
                                  ("float32", "<f4"), ("float64", "<f8"), ("complex64", "<c8"),
                                  ("complex128", "<c16"), ("bf16", "<V2"), ("torch.float16", "<f2")]:
                self.assertEqual(lease.view(name, 2).__cuda_array_interface__["typestr"], typestr, name)
            self.assertEqual(set(vmmbroker.DTYPES) >= {"bfloat16", "float32", "int64"}, True)
            empty = lease.view("float32", (0, 4))
            self.assertEqual(empty.__cuda_array_interface__["data"], (0, False))   # CAI: 0 for zero-size

    def test_view_bounds(self) -> None:
        with self.client.alloc(MiB) as lease:
            n = lease.size // 4
            lease.view("float32", n)                                   # exactly the whole lease
            lease.view("float32", 1, offset=lease.size - 4)            # the last element
            with self.assertRaises(ValueError):
                lease.view("float32", n + 1)
            with self.assertRaises(ValueError):
                lease.view("float32", 1, offset=lease.size)
            with self.assertRaises(ValueError):
                lease.view("uint8", (2, lease.size // 2), offset=1)
            with self.assertRaises(ValueError):
                lease.view("float32", 1, offset=2)                     # misaligned
            with self.assertRaises(ValueError):
                lease.view("float32", 1, offset=-4)
            with self.assertRaises(ValueError):
                lease.view("float32", (-1,))
            with self.assertRaises(ValueError):
                lease.view("float128", 1)
            with self.assertRaises(TypeError):
                lease.view("float32", "4")

    def test_readonly_interface(self) -> None:
        # Read-only in this process: a lease published read-only that this process no longer holds
        # read-write (a process holding it read-write already stays read-write).
        with self.client.alloc(MiB) as lease:
            lid = lease.id
            lease.publish("py-ro", readonly=True)
        try:
            with self.client.attach(name="py-ro") as ro:
                self.assertTrue(ro.readonly)
                self.assertEqual(ro.id, lid)
                self.assertEqual(ro.__cuda_array_interface__["data"], (ro.ptr, True))
                self.assertEqual(ro.view("int32", 4).__cuda_array_interface__["data"], (ro.ptr, True))
        finally:
            self.client.unpublish("py-ro")


# The DLPack structs as dlpack.h declares them, written out here apart from the package's own.
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


api = ctypes.pythonapi
api.PyCapsule_GetName.restype = ctypes.c_char_p
api.PyCapsule_GetName.argtypes = [ctypes.py_object]
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.restype = ctypes.c_int
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
USED = ctypes.c_char_p(b"used_dltensor")    # a consumer's name for the capsule; must outlive it


def consume(capsule) -> int:
    """What a consumer (torch.from_dlpack) does: takes the tensor and renames the capsule."""
    address = api.PyCapsule_GetPointer(capsule, b"dltensor")
    assert api.PyCapsule_SetName(capsule, USED) == 0
    return address


class TestDLPack(ClientTestCase):
    def counting(self, lease: vmmbroker.Lease) -> list:
        """Counts the releases the tensors' deleter makes on `lease`."""
        calls: list = []
        release = lease._export_release

        def counted() -> None:
            calls.append(1)
            release()
        lease._export_release = counted  # type: ignore[method-assign]
        return calls

    def test_device(self) -> None:
        with self.client.alloc(MiB) as lease:
            self.assertEqual(lease.__dlpack_device__(), (2, 0))
            self.assertEqual(lease.view("float32", 4).__dlpack_device__(), (2, 0))

    def test_capsule_fields(self) -> None:
        with self.client.alloc(MiB) as lease:
            cap = lease.__dlpack__()
            self.assertEqual(api.PyCapsule_GetName(cap), b"dltensor")
            m = DLManagedTensor.from_address(api.PyCapsule_GetPointer(cap, b"dltensor"))
            t = m.dl_tensor
            self.assertEqual(t.data, lease.ptr)
            self.assertEqual((t.device.device_type, t.device.device_id), (2, 0))     # kDLCUDA, device 0
            self.assertEqual(t.ndim, 1)
            self.assertEqual(t.shape[0], lease.size)
            self.assertEqual(t.strides[0], 1)
            self.assertEqual((t.dtype.code, t.dtype.bits, t.dtype.lanes), (1, 8, 1))  # kDLUInt, 8 bits
            self.assertEqual(t.byte_offset, 0)
            self.assertTrue(m.deleter)
            del t, m, cap

            cap = lease.view("float32", (4, 8), offset=256).__dlpack__(stream=1, max_version=(1, 0))
            self.assertEqual(api.PyCapsule_GetName(cap), b"dltensor")
            t = DLManagedTensor.from_address(api.PyCapsule_GetPointer(cap, b"dltensor")).dl_tensor
            self.assertEqual(t.data, lease.ptr + 256)
            self.assertEqual(t.ndim, 2)
            self.assertEqual([t.shape[0], t.shape[1]], [4, 8])
            self.assertEqual([t.strides[0], t.strides[1]], [8, 1])                   # in elements
            self.assertEqual((t.dtype.code, t.dtype.bits, t.dtype.lanes), (2, 32, 1))  # kDLFloat
            del t, cap

            for name, code, bits in [("bfloat16", 4, 16), ("int64", 0, 64), ("bool", 6, 8),
                                     ("complex64", 5, 64), ("float16", 2, 16)]:
                cap = lease.view(name, 2).__dlpack__()
                t = DLManagedTensor.from_address(api.PyCapsule_GetPointer(cap, b"dltensor")).dl_tensor
                self.assertEqual((t.dtype.code, t.dtype.bits), (code, bits), name)
                del t, cap

    def test_unconsumed_capsule_deletes_once(self) -> None:
        with self.client.alloc(MiB) as lease:
            calls = self.counting(lease)
            before = _dlpack.live_exports()
            cap = lease.__dlpack__()
            self.assertEqual(_dlpack.live_exports(), before + 1)
            del cap
            gc.collect()
            self.assertEqual(calls, [1])
            self.assertEqual(_dlpack.live_exports(), before)

    def test_consumed_capsule_is_the_consumer_s(self) -> None:
        with self.client.alloc(MiB) as lease:
            calls = self.counting(lease)
            cap = lease.__dlpack__()
            address = consume(cap)
            del cap                                   # consumed: the capsule's destructor leaves it
            gc.collect()
            self.assertEqual(calls, [])
            m = DLManagedTensor.from_address(address)
            self.assertEqual(m.dl_tensor.data, lease.ptr)
            deleter = m.deleter
            done = threading.Thread(target=deleter, args=(address,))   # consumers may delete in any thread
            done.start()
            done.join(CHILD_TIMEOUT_S)
            self.assertEqual(calls, [1])

    def test_free_waits_for_exports(self) -> None:
        lease = self.client.alloc(MiB)
        lid = lease.id
        cap = lease.__dlpack__()
        tensor = consume(cap)
        del cap
        lease.free()                                  # put off: a tensor still uses the memory
        self.assertTrue(lease.freed)
        self.assertIn(lid, listed())
        self.assertNotEqual(lease.ptr, 0)             # still mapped
        with self.assertRaises(BufferError):
            lease.__dlpack__()
        DLManagedTensor.from_address(tensor).deleter(tensor)
        self.assertNotIn(lid, listed())
        with self.assertRaises(ValueError):
            lease.ptr

    def test_close_waits_for_exports(self) -> None:
        c = vmmbroker.connect()
        lease = c.alloc(MiB)
        lid = lease.id
        cap = lease.__dlpack__()
        c.close()
        self.assertIn(lid, listed())
        del cap
        self.assertNotIn(lid, listed())

    def test_export_keeps_lease_alive(self) -> None:
        lease = self.client.alloc(MiB)
        lid = lease.id
        cap = lease.view("int32", 16).__dlpack__()
        del lease
        gc.collect()
        self.assertIn(lid, listed())
        del cap
        gc.collect()
        self.assertNotIn(lid, listed())

    def test_arguments(self) -> None:
        with self.client.alloc(MiB) as lease:
            for kw in ({"stream": None}, {"stream": -1}, {"stream": 1}, {"stream": 2}, {"max_version": (1, 1)},
                       {"dl_device": (2, 0)}, {"copy": False}):
                del_me = lease.__dlpack__(**kw)
                self.assertEqual(api.PyCapsule_GetName(del_me), b"dltensor")
                del del_me
            with self.assertRaises(BufferError):
                lease.__dlpack__(dl_device=(1, 0))
            with self.assertRaises(BufferError):
                lease.__dlpack__(copy=True)
            with self.assertRaises(TypeError):
                lease.__dlpack__(stream="default")
            with self.assertRaises(TypeError):
                lease.__dlpack__(1)  # type: ignore[misc]


class TestSharing(ClientTestCase):
    def test_token(self) -> None:
        uid = other_uid()
        with self.client.alloc(MiB) as lease:
            ctypes.memset(lease.ptr, 0xAB, 4096)
            token = lease.share(uid=uid)
            self.assertRegex(token, r"^[0-9a-f]{32}$")
            r = child_result("attach", {"token": token, "check_len": 4096, "write": [4096, 0xCD, 4096],
                                        "try": ["share", "tokens", "list-all", "mark", "users", "users-all"]})
            self.assertEqual(r["uid"], uid)
            self.assertEqual(r["lease"], {"id": lease.id, "size": lease.size, "device": 0, "readonly": False,
                                          "owner": os.getuid(),
                                          "owner_name": pwd.getpwuid(os.getuid()).pw_name})
            self.assertEqual(r["data"], "ab" * 4096)
            self.assertEqual(ctypes.string_at(lease.ptr + 4096, 4096), b"\xcd" * 4096)   # the same memory
            if uid != os.getuid():
                self.assertEqual(r["share"]["type"], "PermissionDenied")
                self.assertEqual(r["share"]["errno"], errno.EACCES)
                self.assertEqual(r["tokens"]["errno"], errno.EACCES)
                self.assertEqual(r["list-all"]["type"], "PermissionDenied")
                self.assertEqual(r["users-all"]["type"], "PermissionDenied")
                self.assertEqual(r["users-all"]["errno"], errno.EACCES)
                self.assertEqual(r["mark"]["type"], "PermissionDenied")   # another user's memory
            else:
                self.assertEqual(r["mark"], "ok")
            self.assertEqual(r["users"], [uid])          # its own user only, not the lease owner's
            self.assertEqual([h["pid"] for h in listed()[lease.id]["holders"]], [os.getpid()])  # child freed

    def test_readonly_token_tokens_and_revoke(self) -> None:
        uid = other_uid()
        with self.client.alloc(MiB) as lease:
            ro = lease.share(readonly=True)
            rw = lease.share(uid=uid)
            toks = {t["token"]: t for t in lease.tokens()}
            self.assertEqual(toks[ro], {"token": ro, "uid": None, "creator": os.getuid(), "readonly": True})
            self.assertEqual(toks[rw], {"token": rw, "uid": uid, "creator": os.getuid(), "readonly": False})
            r = child_result("attach", {"token": ro, "write": [0, 1, 1], "try": ["share"]})
            self.assertTrue(r["lease"]["readonly"])
            self.assertIn(r["share"]["errno"], (errno.EACCES,))
            self.client.revoke(rw)
            self.assertEqual([t["token"] for t in lease.tokens()], [ro])
            r = child_result("attach", {"token": rw})
            self.assertEqual(r["attach"]["type"], "NotFound")
            self.assertEqual(r["attach"]["errno"], errno.ENOKEY)

    def test_publish_attach_unpublish(self) -> None:
        uid = other_uid()
        me = pwd.getpwuid(os.getuid()).pw_name
        lease = self.client.alloc(MiB)
        lid = lease.id
        ctypes.memset(lease.ptr, 0x42, 64)
        lease.publish("py-weights", uids=[uid] if uid != os.getuid() else [], readonly=True)
        name = f"{me}/py-weights"
        r = child_result("attach", {"name": name, "check_len": 64, "try": ["unpublish", "attach-missing"],
                                    "unpublish": name, "missing": f"{me}/py-missing"})
        self.assertEqual(r["lease"]["id"], lid)
        self.assertTrue(r["lease"]["readonly"])
        self.assertEqual(r["lease"]["owner"], os.getuid())
        self.assertEqual(r["lease"]["owner_name"], me)
        self.assertEqual(r["data"], "42" * 64)
        self.assertEqual(r["attach-missing"]["type"], "NotFound")
        if uid != os.getuid():
            self.assertEqual(r["unpublish"]["type"], "PermissionDenied")
        else:
            self.assertEqual(r["unpublish"], "ok")
            lease.publish("py-weights", readonly=True)
        # Published: the lease outlives every holder.
        lease.free()
        info = listed()[lid]
        self.assertEqual(info["name"], "py-weights")
        self.assertEqual(info["holders"], [])
        with self.client.attach(name="py-weights") as again:     # the owner's own form
            self.assertEqual(again.id, lid)
            self.assertTrue(again.readonly)                       # published read-only: the owner's too
            self.assertEqual(ctypes.string_at(again.ptr, 64), b"\x42" * 64)
        with self.client.attach(name=f"{os.getuid()}/py-weights") as by_uid:
            self.assertEqual(by_uid.id, lid)
        self.client.unpublish("py-weights")
        self.assertNotIn(lid, listed())
        with self.assertRaises(vmmbroker.NotFound):
            self.client.attach(name="py-weights")


def wait_until(what: str, predicate, timeout: float = CHILD_TIMEOUT_S):
    """Polls `predicate` until it returns something true, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class OwnBrokerTestCase(unittest.TestCase):
    """Tests on a daemon of their own (cls.small), started with the class's CONFIG."""

    CONFIG = ""
    small: Broker

    @classmethod
    def setUpClass(cls) -> None:
        cls.small = Broker(cls.CONFIG)

    @classmethod
    def tearDownClass(cls) -> None:
        gc.collect()
        status = cls.small.stop()
        if status not in (0, None):
            raise AssertionError(f"vmmbrokerd ({cls.CONFIG!r}) exited with {status}:\n{cls.small.log()}")


class TestReclaim(OwnBrokerTestCase):
    """Reclaimable leases (Lease.set_reclaimable()), on a daemon of their own with a 16 MiB pool: this
    process leases 12 MiB and marks it, and a child's alloc(8 MiB, wait=...) needs it back."""

    # A user limit above the pool: this process and its waiting child (one user, unless root) lease 20 MiB.
    CONFIG = "[Broker]\nCapacity=16M\nReclaimTimeout=60s\n[Limits]\nMaxBytes=1G\nMaxLeases=64\n"

    def setUp(self) -> None:
        self.client = vmmbroker.connect(self.small.socket)
        # Every earlier lease gone and scrubbed: the whole pool is room (cached slabs count as room).
        wait_until("an idle pool", lambda: all(d["leased"] == 0 and d["scrubbing"] == 0 and d["waiters"] == 0
                                               for d in self.client.status()))

    def tearDown(self) -> None:
        self.client.close()

    def info(self, lid: str) -> dict | None:
        return {l["id"]: l for l in self.client.list()}.get(lid)

    def waiter(self, size: int = 8 * MiB, wait: float = CHILD_TIMEOUT_S) -> subprocess.Popen:
        """Another process's alloc(size, wait=wait) on the full pool."""
        return run_child("alloc-wait", {"size": size, "wait": wait}, as_other=False,
                         env=dict(os.environ, VMMBROKER_SOCKET=self.small.socket))

    def waiter_result(self, p: subprocess.Popen) -> dict:
        out, _ = p.communicate(timeout=CHILD_TIMEOUT_S)
        self.assertEqual(p.returncode, 0, out)
        return json.loads(out.strip().splitlines()[-1])

    def test_given_back_to_a_waiting_alloc(self) -> None:
        lease = self.client.alloc(12 * MiB, label="cache")
        ctypes.memset(lease.ptr, 0x5A, 4096)
        asked = threading.Event()
        seen: dict = {}

        def give_back(l: vmmbroker.Lease) -> bool:
            seen["lease"] = l
            seen["left_s"] = l.reclaim_deadline - time.monotonic()     # ReclaimTimeout=60s, asked just now
            seen["thread"] = threading.current_thread() is not threading.main_thread()
            seen["data"] = ctypes.string_at(l.ptr, 4)            # still mapped while the callback runs
            for name, call in (("free", l.free), ("share", l.share), ("mark", lambda: l.set_reclaimable(0)),
                               ("close", l.client.close)):
                try:
                    call()
                except vmmbroker.Error as e:
                    seen[name] = e.errno
            asked.set()
            return True

        lease.set_reclaimable(3, give_back)
        self.assertEqual(lease.reclaim_priority, 3)
        self.assertIsNone(lease.reclaim_deadline)                      # only in its own callback
        info = self.info(lease.id)
        self.assertEqual((info["reclaim_priority"], info["reclaim"]), (3, "marked"))
        p = self.waiter()
        self.assertTrue(asked.wait(CHILD_TIMEOUT_S), "the callback was not called")
        r = self.waiter_result(p)
        self.assertEqual(r["lease"]["size"], 8 * MiB)              # served with the memory given back
        wait_until("the library to finish giving it back", lambda: lease.reclaimed)
        self.assertIs(seen["lease"], lease)
        self.assertTrue(30 < seen["left_s"] <= 60, seen["left_s"])
        self.assertIsNone(lease.reclaim_deadline)
        self.assertTrue(seen["thread"])
        self.assertEqual(seen["data"], b"\x5a" * 4)
        for name in ("free", "share", "mark", "close"):        # refused in the callback, nothing broken
            self.assertEqual(seen[name], errno.EDEADLK, name)
        self.assertFalse(self.client.closed)
        self.assertIsNone(self.info(lease.id))
        self.assertIsNone(lease.reclaim_priority)
        self.assertIn("reclaimed", repr(lease))
        # The memory is gone: whatever would hand out its address raises ESTALE.
        for touch in (lambda: lease.ptr, lambda: lease.__cuda_array_interface__, lambda: lease.__dlpack__(),
                      lambda: lease.view("float32", 4).ptr, lambda: lease.share(),
                      lambda: lease.set_reclaimable(0)):
            with self.assertRaises(vmmbroker.Error) as cm:
                touch()
            self.assertEqual(cm.exception.errno, errno.ESTALE)
            self.assertIn("given back", cm.exception.strerror)
        lease.free()                                             # only the object is left to end
        self.assertTrue(lease.freed)
        self.assertTrue(lease.reclaimed)
        self.assertEqual(lease._reclaim_fns, [])                 # the C callback is released
        with self.assertRaises(ValueError):
            lease.ptr
        with self.client.alloc(2 * MiB) as again:               # the client goes on as before
            self.assertEqual(again.size, 2 * MiB)

    def test_given_back_without_a_callback(self) -> None:
        lease = self.client.alloc(12 * MiB)
        lease.set_reclaimable(0)
        r = self.waiter_result(self.waiter())
        self.assertEqual(r["lease"]["size"], 8 * MiB)
        wait_until("the library to finish giving it back", lambda: lease.reclaimed)
        with self.assertRaises(vmmbroker.Error) as cm:
            lease.ptr
        self.assertEqual(cm.exception.errno, errno.ESTALE)
        lease.free()

    def test_callback_that_raises_refuses(self) -> None:
        lease = self.client.alloc(12 * MiB)
        ctypes.memset(lease.ptr, 0x33, 4096)
        asked = threading.Event()

        def broken(l: vmmbroker.Lease) -> bool:
            asked.set()
            raise RuntimeError("the cache is busy")

        lease.set_reclaimable(0, broken)
        with self.assertLogs("vmmbroker", "ERROR") as logs:
            p = self.waiter()
            self.assertTrue(asked.wait(CHILD_TIMEOUT_S), "the callback was not called")
            # Refused: the library unmarks the lease (after the package logged), and the waiter waits on.
            wait_until("the lease to be unmarked", lambda: self.info(lease.id).get("reclaim") is None)
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertIn(lease.id, logs.records[0].getMessage())
        self.assertIs(logs.records[0].exc_info[0], RuntimeError)
        self.assertFalse(lease.reclaimed)
        self.assertIsNone(lease.reclaim_priority)
        self.assertEqual(ctypes.string_at(lease.ptr, 4096), b"\x33" * 4096)   # still ours, still mapped
        self.assertEqual(self.client.status()[0]["waiters"], 1)
        lease.free()                                             # now the waiter gets the room
        self.assertEqual(self.waiter_result(p)["lease"]["size"], 8 * MiB)

    def test_callback_that_refuses_and_a_live_export(self) -> None:
        lease = self.client.alloc(12 * MiB)
        cap = lease.__dlpack__()                                 # a framework tensor still uses it
        asked = threading.Event()
        lease.set_reclaimable(0, lambda l: asked.set() or True)
        with self.assertLogs("vmmbroker", "WARNING") as logs:
            p = self.waiter()
            self.assertTrue(asked.wait(CHILD_TIMEOUT_S))
            wait_until("the lease to be unmarked", lambda: self.info(lease.id).get("reclaim") is None)
        self.assertIn("DLPack", logs.output[0])
        self.assertFalse(lease.reclaimed)
        self.assertNotEqual(lease.ptr, 0)
        # Marked again, with a callback that says no: refused, silently.
        said_no = threading.Event()
        lease.set_reclaimable(1, lambda l: said_no.set() and False)
        del cap
        self.assertTrue(said_no.wait(CHILD_TIMEOUT_S))
        wait_until("the lease to be unmarked", lambda: self.info(lease.id).get("reclaim") is None)
        self.assertFalse(lease.reclaimed)
        lease.free()
        self.assertEqual(self.waiter_result(p)["lease"]["size"], 8 * MiB)

    def test_unmark(self) -> None:
        lease = self.client.alloc(12 * MiB)
        asked = threading.Event()
        lease.set_reclaimable(7, lambda l: asked.set() or True)
        self.assertEqual(self.info(lease.id)["reclaim"], "marked")
        self.assertEqual(len(lease._reclaim_fns), 1)
        lease.set_reclaimable(None)
        self.assertIsNone(lease.reclaim_priority)
        self.assertEqual(lease._reclaim_fns, [])                 # the C callback is released
        info = self.info(lease.id)
        self.assertIsNone(info.get("reclaim"))
        self.assertIsNone(info.get("reclaim_priority"))
        lease.set_reclaimable(None)                              # twice is harmless
        r = self.waiter_result(self.waiter(wait=1.0))            # nobody to ask: it waits its second, in vain
        self.assertEqual(r["alloc"]["type"], "OutOfMemory")
        self.assertFalse(asked.is_set())
        self.assertFalse(lease.reclaimed)
        lease.free()

    def test_arguments(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            for bad, exc in ((-1, ValueError), (1 << 31, ValueError), (True, TypeError), ("0", TypeError),
                             (1.5, TypeError)):
                with self.assertRaises(exc):
                    lease.set_reclaimable(bad)                   # type: ignore[arg-type]
            with self.assertRaises(TypeError):
                lease.set_reclaimable(0, "not callable")         # type: ignore[arg-type]
            with self.assertRaises(ValueError):
                lease.set_reclaimable(None, lambda l: True)
            lease.set_reclaimable(vmmbroker.MAX_PRIORITY)
            self.assertEqual(self.info(lease.id)["reclaim_priority"], vmmbroker.MAX_PRIORITY)
        with self.assertRaises(ValueError):
            lease.set_reclaimable(0)                             # freed

    def test_not_holder_s_to_mark(self) -> None:
        # A read-only hold (here: through a name published read-only) may not offer the owner's memory.
        with self.client.alloc(2 * MiB) as lease:
            lease.publish("py-reclaim-ro", readonly=True)
        try:
            with self.client.attach(name="py-reclaim-ro") as ro:
                self.assertTrue(ro.readonly)
                with self.assertRaises(vmmbroker.PermissionDenied) as cm:
                    ro.set_reclaimable(0, lambda l: True)
                self.assertEqual(cm.exception.errno, errno.EACCES)
                self.assertIsNone(ro.reclaim_priority)
                self.assertIsNone(self.info(ro.id).get("reclaim"))
        finally:
            self.client.unpublish("py-reclaim-ro")


class TestParking(ClientTestCase):
    """Lease.park(), unpark() and parked: the content goes to host memory and comes back at the same address."""

    def test_park_unpark(self) -> None:
        with self.client.alloc(66 * MiB, label="parked") as lease:   # two slabs: 64 MiB and 2 MiB
            data = os.urandom(4096)
            ptr = lease.ptr
            for at in (0, 64 * MiB - 2048, 66 * MiB - 4096):          # across the slabs' boundary too
                ctypes.memmove(ptr + at, data, len(data))
            self.assertFalse(lease.parked)
            self.assertIs(lease.park(), True)                          # the only holder: moved now
            self.assertTrue(lease.parked)
            self.assertEqual(lease.ptr, ptr)                           # the address is kept
            info = listed()[lease.id]
            if "parked" in info:
                self.assertTrue(info["parked"], info)
            with self.assertRaises(vmmbroker.Error) as cm:
                lease.park()
            self.assertEqual(cm.exception.errno, errno.EALREADY)

            lease.unpark()
            self.assertFalse(lease.parked)
            self.assertEqual(lease.ptr, ptr)
            for at in (0, 64 * MiB - 2048, 66 * MiB - 4096):
                self.assertEqual(ctypes.string_at(ptr + at, len(data)), data)
            with self.assertRaises(vmmbroker.Error) as cm:
                lease.unpark()
            self.assertEqual(cm.exception.errno, errno.EALREADY)
            ctypes.memset(ptr, 0x11, 4096)                             # mapped read-write again

    def test_park_ends_the_mark(self) -> None:
        """Moving into host memory ends a lease's reclaimable mark, in the broker and in the object."""
        with self.client.alloc(4 * MiB) as lease:
            lease.set_reclaimable(3)
            self.assertEqual(lease.reclaim_priority, 3)
            self.assertEqual(listed()[lease.id].get("reclaim"), "marked")
            self.assertIs(lease.park(), True)
            self.assertIsNone(lease.reclaim_priority)
            self.assertIsNone(listed()[lease.id].get("reclaim"))
            lease.unpark()
            self.assertIsNone(lease.reclaim_priority)
            lease.set_reclaimable(4)                                   # offered again, as documented
            self.assertEqual(listed()[lease.id].get("reclaim"), "marked")

    def test_free_while_parked(self) -> None:
        lease = self.client.alloc(4 * MiB)
        lid = lease.id
        self.assertTrue(lease.park())
        lease.free()                                                   # only the reservation was left here
        self.assertNotIn(lid, listed())
        self.assertFalse(lease.parked)
        with self.assertRaises(ValueError):
            lease.unpark()
        with self.assertRaises(ValueError):
            lease.park()

    def test_bad_arguments(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            with self.assertRaises(TypeError):
                lease.park("0")                                        # type: ignore[arg-type]
            with self.assertRaises(TypeError):
                lease.park(True)
            self.assertFalse(lease.parked)

    def test_error_class(self) -> None:
        from vmmbroker import _errors
        self.assertIn("OutOfHostMemory", vmmbroker.__all__)
        self.assertTrue(issubclass(vmmbroker.OutOfHostMemory, vmmbroker.Error))
        e = _errors.error(-errno.ENOSPC, "no host memory")
        self.assertIs(type(e), vmmbroker.OutOfHostMemory)
        self.assertEqual((e.errno, e.message), (errno.ENOSPC, "no host memory"))
        self.assertIs(type(_errors.error(errno.EDQUOT)), vmmbroker.QuotaExceeded)


class TestReading(ClientTestCase):
    """Lease.readinto() and read() (vmmb_lease_read()): bytes of a lease copied to host memory."""

    def test_read_back(self) -> None:
        with self.client.alloc(66 * MiB) as lease:                    # two slabs: 64 MiB and 2 MiB
            self.assertEqual(lease.read(4096), bytes(4096))           # fresh memory reads zero
            data = os.urandom(8192)
            ctypes.memmove(lease.ptr + 64 * MiB - 4096, data, len(data))
            self.assertEqual(lease.read(8192, 64 * MiB - 4096), data)   # across the slabs' boundary
            buf = bytearray(100)
            self.assertEqual(lease.readinto(memoryview(buf)[10:20], 64 * MiB - 4096), 10)
            self.assertEqual(bytes(buf[10:20]), data[:10])
            self.assertEqual(bytes(buf[:10]) + bytes(buf[20:]), bytes(90))   # nothing else written
            import array
            words = array.array("I", [0] * 4)
            lease.readinto(words, 64 * MiB - 4096)
            self.assertEqual(words.tobytes(), data[:16])
            self.assertEqual(lease.read(0, lease.size), b"")

    def test_read_only_hold(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            ctypes.memset(lease.ptr, 0x42, 64)
            with self.client.attach(token=lease.share(), readonly=True) as ro:
                self.assertTrue(ro.readonly)
                self.assertEqual(ro.read(64), b"\x42" * 64)

    def test_bounds_and_arguments(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            buf = bytearray(b"x" * 16)
            for offset, n in ((2 * MiB, 1), (2 * MiB - 8, 16), (2**64 - 1, 1), (2**64, 1), (2 * MiB + 1, 0)):
                with self.assertRaises(vmmbroker.Error) as cm:
                    lease.readinto(memoryview(buf)[:n], offset)
                self.assertEqual(cm.exception.errno, errno.ERANGE)
                self.assertIn(lease.id, str(cm.exception))
            self.assertEqual(buf, bytearray(b"x" * 16))              # nothing written on a refusal
            with self.assertRaises(ValueError):
                lease.readinto(buf, -1)
            with self.assertRaises(TypeError):
                lease.readinto(b"read-only bytes")
            with self.assertRaises(TypeError):
                lease.readinto(memoryview(bytearray(16))[::2])      # not contiguous
            with self.assertRaises(ValueError):
                lease.read(-1)
        with self.assertRaises(ValueError):
            lease.read(4)                                           # freed

    def test_parked(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            ctypes.memset(lease.ptr, 0x17, 32)
            self.assertTrue(lease.park())
            with self.assertRaises(vmmbroker.Error) as cm:
                lease.read(32)
            self.assertEqual(cm.exception.errno, errno.ENXIO)
            lease.unpark()
            self.assertEqual(lease.read(32), b"\x17" * 32)


class TestWeightStoreHeader(ClientTestCase):
    """vmmbroker.weights reads a store's header through Lease.readinto(): the part of attach_state_dict()
    that needs no PyTorch (the rest runs on a GPU: tests/gpu/python/weights.py)."""

    class _Base:
        """What _read_header() uses of the uint8 tensor over the lease: its length."""
        def __init__(self, size: int) -> None:
            self.shape = (size,)

    def test_header_read_back(self) -> None:
        import vmmbroker.weights as w
        for n in (3, 4000):             # one read, and a header past FIRST_READ (two)
            entries, size = w.plan_layout([(f"layer.{i}.weight", "float32", [4], None) for i in range(n)])
            header, data_offset = w.encode_layout(entries, size, {"model": "test"})
            self.assertEqual(len(header) > w.FIRST_READ, n == 4000)
            with self.client.alloc(data_offset + size) as lease:
                ctypes.memmove(lease.ptr, header, len(header))
                ctypes.memset(lease.ptr + len(header), 0xEE, 64)      # what follows is not read
                got = w._read_header(self._Base(lease.size), lease)
                self.assertEqual(got, header)
                names, groups, off, metadata = w._parse(got, lease.size)
                self.assertEqual((len(names), off, metadata), (n, data_offset, {"model": "test"}))

    def test_not_a_store(self) -> None:
        import vmmbroker.weights as w
        with self.client.alloc(2 * MiB) as lease:                    # zeros: no magic
            with self.assertRaises(w.LayoutError):
                w._read_header(self._Base(lease.size), lease)
            header, _ = w.encode_layout(*w.plan_layout([("t", "float32", [4], None)]))
            big = bytearray(header)
            big[16:24] = (10 * MiB).to_bytes(8, "little")             # a JSON size past the lease,
            big[24:32] = (11 * MiB).to_bytes(8, "little")             # the data after it
            ctypes.memmove(lease.ptr, bytes(big), len(big))
            with self.assertRaises(w.LayoutError) as cm:
                w._read_header(self._Base(lease.size), lease)
            self.assertIn("in a lease of", str(cm.exception))
            big[16:24] = (w.MAX_JSON + 1).to_bytes(8, "little")       # more JSON than any attach reads:
            big[24:32] = (w.MAX_JSON + 4096).to_bytes(8, "little")    # refused from the prefix alone
            ctypes.memmove(lease.ptr, bytes(big), len(big))
            with self.assertRaises(w.LayoutError) as cm:
                w._read_header(self._Base(lease.size), lease)
            self.assertIn("more than the", str(cm.exception))

    def test_without_pytorch(self) -> None:
        """The module imports without PyTorch (it imports PyTorch with itself when there is one); publish
        and attach then say what they need, before anything is leased or attached."""
        import vmmbroker.weights as w
        if w.torch is not None:
            self.skipTest("PyTorch is installed here: the module imported vmmbroker.torch with itself")
        self.assertIsNone(w._vt)
        before = self.client.list()
        for call in (lambda: w.attach_state_dict(self.client, "no-such-store"),
                     lambda: w.publish_state_dict(self.client, "py-no-torch", {})):
            with self.assertRaises(ImportError) as cm:
                call()
            self.assertIn("needs PyTorch", str(cm.exception))
            self.assertIn("No module named 'torch'", str(cm.exception))
        self.assertEqual(self.client.list(), before)

    def test_unusable_pytorch(self) -> None:
        """A PyTorch that vmmbroker.torch cannot use (here a stand-in `torch` with no torch.cuda.MemPool)
        still lets the module import; publish and attach then name what failed."""
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "torch", "cuda"))
            for path, text in (("__init__.py", "from . import cuda\n"), ("cuda/__init__.py", "")):
                with open(os.path.join(d, "torch", path), "w") as f:
                    f.write(text)
            code = ("import vmmbroker.weights as w\n"
                    "assert w.torch is not None and w._vt is None\n"
                    "try:\n"
                    "    w.attach_state_dict(None, 'x')\n"
                    "except ImportError as e:\n"
                    "    print('ImportError:', e)\n")
            env = dict(os.environ, PYTHONPATH=d + os.pathsep + os.environ.get("PYTHONPATH", ""))
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("needs PyTorch", out.stdout)
        self.assertIn("vmmbroker.torch: AttributeError", out.stdout)
        self.assertIn("MemPool", out.stdout)


class TestParkingLimits(OwnBrokerTestCase):
    """A park over the owner's host-bytes limit is refused, and the lease is mapped again as it was."""

    CONFIG = "[Limits]\nMaxBytes=1G\nMaxHostBytes=4M\n"

    def test_over_host_bytes(self) -> None:
        with vmmbroker.connect(self.small.socket) as client:
            small = client.alloc(4 * MiB)
            self.assertTrue(small.park())                              # 4 MiB: at the limit
            with client.alloc(6 * MiB) as lease:
                ctypes.memset(lease.ptr, 0x5A, lease.size)
                with self.assertRaises(vmmbroker.QuotaExceeded) as cm:
                    lease.park()
                self.assertEqual(cm.exception.errno, errno.EDQUOT)
                self.assertIn("host", cm.exception.strerror.lower())   # the host-bytes limit, not MaxBytes
                self.assertFalse(lease.parked)                         # mapped again, as it was
                self.assertEqual(ctypes.string_at(lease.ptr, lease.size), b"\x5a" * lease.size)
            small.unpark()
            small.free()


class TestParkingHostFull(OwnBrokerTestCase):
    """A park that the broker's host memory cannot hold: OutOfHostMemory, and the lease is mapped again."""

    CONFIG = "[Broker]\nHostCapacity=4M\n[Limits]\nMaxBytes=1G\nMaxHostBytes=1G\n"

    def test_out_of_host_memory(self) -> None:
        with vmmbroker.connect(self.small.socket) as client, client.alloc(6 * MiB) as lease:
            ctypes.memset(lease.ptr, 0x6B, lease.size)
            with self.assertRaises(vmmbroker.OutOfHostMemory) as cm:
                lease.park()
            self.assertEqual(cm.exception.errno, errno.ENOSPC)
            self.assertFalse(lease.parked)
            self.assertEqual(ctypes.string_at(lease.ptr, lease.size), b"\x6b" * lease.size)


class TestKeeping(ClientTestCase):
    """free(keep=True) (vmmb_free_keep()): the same lease and mapping back for this process's next alloc of
    its size; give_back_kept() and close() give kept leases back."""

    def test_ctypes_layer(self) -> None:
        lib = _lib.lib()
        handle = self.client._check()
        first, again = ctypes.c_void_p(), ctypes.c_void_p()
        self.assertEqual(lib.vmmb_alloc(handle, 4 * MiB, 0, b"py-keep", ctypes.byref(first)), 0)
        lid, ptr = lib.vmmb_lease_id(first).decode(), lib.vmmb_lease_ptr(first)
        ctypes.memset(ptr, 0x5A, 4 * MiB)
        self.assertEqual(_lib.free_keep(first), 0)
        self.assertIs(listed()[lid].get("kept"), True)     # the first keep on a connection is answered
        self.assertEqual(lib.vmmb_alloc(handle, 3 * MiB, 0, None, ctypes.byref(again)), 0)   # 4 MiB too
        self.assertEqual(lib.vmmb_lease_id(again).decode(), lid)
        self.assertEqual(lib.vmmb_lease_ptr(again), ptr)
        self.assertEqual(ctypes.string_at(ptr, 4 * MiB), bytes(4 * MiB))                      # zeroed
        self.assertEqual(_lib.free_keep(again), 0)
        self.assertEqual(_lib.give_back_kept(handle), 1)
        self.assertNotIn(lid, listed())
        self.assertEqual(_lib.give_back_kept(handle), 0)
        self.assertEqual(_lib.give_back_kept(None), -errno.EINVAL)

    def test_free_keep(self) -> None:
        lease = self.client.alloc(6 * MiB, label="py-kept")
        lid, ptr = lease.id, lease.ptr
        ctypes.memset(ptr, 0x33, lease.size)
        lease.free(keep=True)
        self.assertTrue(lease.freed)
        self.assertIs(listed()[lid].get("kept"), True)
        with self.assertRaises(ValueError):
            lease.ptr                                   # the object is done with, as after free()
        lease.free(keep=True)                           # idempotent

        other = self.client.alloc(2 * MiB)              # another size: a lease of its own
        self.assertNotEqual(other.id, lid)
        again = self.client.alloc(6 * MiB, label="py-again")
        self.assertEqual((again.id, again.ptr, again.size), (lid, ptr, 6 * MiB))
        self.assertEqual(ctypes.string_at(ptr, again.size), bytes(again.size))
        info = listed()[lid]
        self.assertFalse(info.get("kept", False))
        self.assertEqual(info["label"], "py-again")
        other.free()
        again.free()
        self.assertNotIn(lid, listed())

    def test_give_back_kept_and_close(self) -> None:
        c = vmmbroker.connect()
        ids = []
        for size in (2 * MiB, 4 * MiB):
            lease = c.alloc(size)
            ids.append(lease.id)
            lease.free(keep=True)
        c.alloc(8 * MiB).free()                         # answered: after the one-way second keep
        self.assertTrue(all(listed()[i].get("kept") for i in ids))
        self.assertEqual(c.give_back_kept(), 2)
        self.assertFalse(set(ids) & set(listed()))
        self.assertEqual(c.give_back_kept(), 0)
        lease = c.alloc(2 * MiB)
        lid = lease.id
        lease.free(keep=True)
        self.assertIn(lid, listed())
        c.close()                                       # gives back what it kept
        self.assertNotIn(lid, listed())
        with self.assertRaises(ValueError):
            c.give_back_kept()

    def test_not_kept(self) -> None:
        shared = self.client.alloc(2 * MiB)
        sid = shared.id
        shared.share()
        shared.free(keep=True)                          # shared: a plain free
        attached_from = self.client.alloc(4 * MiB)
        attached = self.client.attach(token=attached_from.share())
        aid = attached.id
        attached.free(keep=True)                        # attached: a plain free of that hold
        self.client.alloc(8 * MiB).free()               # answered: after the one-way frees
        self.assertNotIn(sid, listed())
        self.assertFalse(listed()[aid].get("kept", False))
        attached_from.free()
        self.assertNotIn(aid, listed())

    def test_keep_waits_for_exports(self) -> None:
        lease = self.client.alloc(2 * MiB)
        lid = lease.id
        tensor = consume(lease.__dlpack__())
        lease.free(keep=True)                           # put off: a tensor still uses the memory
        self.assertFalse(listed()[lid].get("kept", False))
        DLManagedTensor.from_address(tensor).deleter(tensor)
        self.assertIs(listed()[lid].get("kept"), True)  # kept then, as asked
        self.assertEqual(self.client.give_back_kept(), 1)

    def test_arguments(self) -> None:
        with self.client.alloc(2 * MiB) as lease:
            with self.assertRaises(ValueError):
                lease.free(stream=0, keep=True)         # keep does not wait for a stream
            with self.assertRaises(TypeError):
                lease.free(keep=1)                      # type: ignore[arg-type]
            self.assertFalse(lease.freed)


class TestExit(unittest.TestCase):
    """A lease is given back when its process exits, however it exits."""

    def exit_child(self, how: str, **args) -> tuple[str, list]:
        p = run_child("alloc-exit", dict(args, how=how), as_other=False, stdin=subprocess.PIPE)
        lines = [p.stdout.readline()]
        lid = json.loads(lines[0])["id"]
        self.assertIn(lid, listed())                          # held while the child lives
        if how == "kill":
            p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=CHILD_TIMEOUT_S)       # closes its stdin: it goes on and exits
        lines += out.splitlines()
        return lid, [json.loads(l) for l in lines[1:] if l.strip()]

    def test_exit_without_freeing(self) -> None:
        lid, _ = self.exit_child("exit")                      # os._exit(): no atexit, no __del__
        self.assertNotIn(lid, listed())                       # the broker drops a dead process's holds

    def test_killed(self) -> None:
        lid, _ = self.exit_child("kill")
        self.assertNotIn(lid, listed())

    def test_atexit_frees(self) -> None:
        lid, rest = self.exit_child("atexit")
        self.assertEqual(len(rest), 1, rest)
        self.assertNotIn(lid, rest[0]["after_atexit"])        # freed by the package before the process ended
        self.assertNotIn(lid, listed())

    def test_exit_with_a_live_export(self) -> None:
        lid, _ = self.exit_child("atexit", export=True)
        self.assertNotIn(lid, listed())


class TestTorchEntryPoints(unittest.TestCase):
    """libvmmbroker's PyTorch allocator entry points (client/torch.c), called as PyTorch calls them."""

    def test_alloc_free_release(self) -> None:
        if not _lib.has_symbol("vmmb_torch_alloc") or not _lib.has_symbol("vmmb_torch_free"):
            self.skipTest("libvmmbroker has no vmmb_torch_alloc/vmmb_torch_free yet")
        r = child_result("torch", {"size": 3 * MiB}, as_other=False)
        self.assertNotEqual(r["ptr"], 0)
        self.assertEqual(r["readback"], "5a" * 16)
        self.assertGreaterEqual(r["held_after_alloc"], 3 * MiB)
        if "lease_id" in r:                                   # the segment is a lease labelled "torch"
            self.assertEqual(r["labels"].get(r["lease_id"]), "torch", r)
        if "held_after_release" in r:
            self.assertGreaterEqual(r["release_all"], 0)
            self.assertEqual(r["held_after_release"], 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
