"""MemcacheBackend: against a fake where the real client cannot run, against the real library where it can.

memcache-hybrid 1.3.0's memory-owning client cannot start on this host: its
``init`` fails the Ascend driver check whatever the protocol (host_tcp and
host_shm included). So:

- the data paths run against ``memcache_fake`` (its codes: see that module);
- ``test_fake_matches_real_library`` replays calls on the real library (a
  lookup-only client and a real meta service, which do run here) and on the
  fake, and requires the same answers;
- the real class must still have every method the backend calls, with
  signatures the recorded calls bind to (a library change breaks these tests);
- against a real meta service: the worker's backend fails with an error that
  names the driver check, the scheduler's lookup-only backend works, and a
  dead meta service costs a call the deadline, not the library's 60 s.

What every backend does (round trips, missing keys, repeated keys, close) is
in ``test_backend_contract.py``.

Under ``CI`` a missing prerequisite (memcache_hybrid, a free meta-service
lock) fails instead of skipping.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.memcache_fake import (
    FakeDistributedObjectStore,
    FakeMetaPort,
    FakeMetaService,
    free_port,
    write_local_conf,
)
from vllm_aio.backends import memcache
from vllm_aio.backends.base import Memory, Status
from vllm_aio.backends.memcache import (
    CHUNK,
    INSTALL_HINT,
    STORE_METHODS,
    MemcacheBackend,
    MemcacheSettings,
    MemcacheUnavailableError,
    import_store,
)
from vllm_aio.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def skip_or_fail(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI is set and a Memcache prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason)


def require_memcache():
    try:
        import memcache_hybrid
    except (ImportError, OSError) as e:
        skip_or_fail(f"memcache_hybrid not importable ({e}); {INSTALL_HINT}")
    return memcache_hybrid


def unique(n: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}-{i}" for i in range(n)]


# -- the fake's world: a TCP port that answers like a meta service, a config file --------------


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[FakeMetaPort, Path]]:
    port = FakeMetaPort()
    yield port, write_local_conf(tmp_path / "mmc-local.conf", port.port, port.port)
    port.down()


def fake_backend(world, meta: FakeMetaService | None = None, lookup_only: bool = False, **kwargs):
    _, conf = world
    meta = meta or FakeMetaService()
    store = FakeDistributedObjectStore(meta)
    settings = MemcacheSettings.load({}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    backend = MemcacheBackend(replace(settings, lookup_only=lookup_only), store_factory=lambda: store, **kwargs)
    return backend, store, meta


class Buffers:
    """n values of ``parts`` segments each, in two ctypes buffers (source and destination)."""

    def __init__(self, n: int, parts: int = 1, part: int = 256) -> None:
        self.n, self.parts, self.part = n, parts, part
        size = n * parts * part
        self.src = (ctypes.c_ubyte * size)(*[(i * 7 + 3) % 251 for i in range(size)])
        self.dst = (ctypes.c_ubyte * size)()

    def segments(self, buf, part: int | None = None) -> list[list[tuple[int, int]]]:
        base, part = ctypes.addressof(buf), part or self.part
        # key i's segments are scattered: segment j sits at (j * n + i)
        return [[(base + (j * self.n + i) * self.part, part) for j in range(self.parts)] for i in range(self.n)]

    def same(self) -> bool:
        return bytes(self.src) == bytes(self.dst)


# -- settings -----------------------------------------------------------------------------------


def test_settings_come_from_the_library_config_file(world):
    _, conf = world
    s = MemcacheSettings.load(environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert (s.config_path, s.protocol, s.device_id) == (str(conf), "host_tcp", None)
    assert s.meta_service_url.startswith("tcp://127.0.0.1:")
    s = MemcacheSettings.load({"device_id": 3}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert s.device_id == 3


def test_settings_errors_name_the_key(world, tmp_path):
    _, conf = world
    with pytest.raises(ConfigError, match="MMC_LOCAL_CONFIG_PATH: not set"):
        MemcacheSettings.load(environ={})
    def env(path):
        return {"MMC_LOCAL_CONFIG_PATH": str(path)}

    with pytest.raises(ConfigError, match="unknown Memcache setting.*config_path, dram_size"):
        MemcacheSettings.load({"config_path": str(conf), "dram_size": "1GB"}, environ=env(conf))
    with pytest.raises(ConfigError, match="cannot read"):
        MemcacheSettings.load(environ=env(tmp_path / "nope.conf"))
    (tmp_path / "bad.conf").write_text("ock.mmc.meta_service_url = 127.0.0.1:5000\n")
    with pytest.raises(ConfigError, match="tcp://host:port"):
        MemcacheSettings.load(environ=env(tmp_path / "bad.conf"))
    (tmp_path / "none.conf").write_text("# ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n")
    with pytest.raises(ConfigError, match="meta_service_url: missing"):
        MemcacheSettings.load(environ=env(tmp_path / "none.conf"))
    (tmp_path / "trailing.conf").write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000  # no\n")
    with pytest.raises(ConfigError, match="tcp://host:port"):  # the library keeps the comment in the value
        MemcacheSettings.load(environ=env(tmp_path / "trailing.conf"))
    with pytest.raises(ConfigError, match="^device_id: expected an integer"):
        MemcacheSettings.load({"device_id": "0"}, environ=env(conf))
    with pytest.raises(ConfigError, match="unknown Memcache setting.*memory; accepted: device_id"):
        MemcacheSettings.load({"memory": "device"}, environ=env(conf))  # the caller declares it (see below)


def test_import_failure_names_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)
    with pytest.raises(MemcacheUnavailableError, match=re.escape(INSTALL_HINT)):
        import_store()


# -- construction ---------------------------------------------------------------------------------


def test_unreachable_meta_service_fails_before_the_client_is_made(world):
    port, _ = world
    port.down()
    made = []
    _, conf = world
    settings = MemcacheSettings.load({}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    with pytest.raises(MemcacheUnavailableError, match="unreachable"):
        MemcacheBackend(settings, connect_timeout=0.5, store_factory=lambda: made.append(1))
    assert made == []  # init against a dead meta service would block
    port.up()


def test_init_failure_names_the_driver_check(world, monkeypatch):
    monkeypatch.setattr(memcache, "DRIVER_FILES", ("/nonexistent/ascend_install.info",))
    with pytest.raises(MemcacheUnavailableError, match="the Ascend driver check") as err:
        fake_backend(world, FakeMetaService(npu=False))
    assert "host_tcp" in str(err.value) and "NPU" in str(err.value)


def test_lookup_only_backend_needs_no_npu_and_moves_nothing(world):
    backend, store, meta = fake_backend(world, FakeMetaService(npu=False), lookup_only=True)
    assert ("init", (0,), {"init_bm": False}) in store.calls
    meta.values["k"] = b"x"
    assert backend.batch_exists(["k", "j"]) == [True, False]
    backend.register_memory(0x1000, 4096)  # the real call would segfault: it must not be made
    assert not any(c[0] == "register_buffer" for c in store.calls)
    with pytest.raises(RuntimeError, match="lookup-only"):
        backend.batch_put(["k"], [[(0x1000, 1)]])
    backend.close()


def test_backends_of_one_process_share_its_client(world):
    """Seen: closing one DistributedObjectStore un-initializes every other in the process."""
    _, conf = world
    meta = FakeMetaService()
    stores: list[FakeDistributedObjectStore] = []

    def factory() -> FakeDistributedObjectStore:
        stores.append(FakeDistributedObjectStore(meta))
        return stores[-1]

    settings = MemcacheSettings.load({}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    worker = MemcacheBackend(settings, store_factory=factory)
    scheduler = MemcacheBackend(replace(settings, lookup_only=True), store_factory=factory)
    assert len(stores) == 1 and [c for c in stores[0].calls if c[0] == "init"] == [("init", (0,), {"init_bm": True})]
    bufs, key = Buffers(1), unique(1)
    assert worker.batch_put(key, bufs.segments(bufs.src)) == [Status.OK]
    scheduler.close()  # must not free the worker's client
    assert "close" not in [c[0] for c in stores[0].calls]
    assert worker.batch_exists(key) == [True]
    worker.close()
    assert [c[0] for c in stores[0].calls].count("close") == 1
    # A lookup-only client first: a memory-owning backend cannot join it.
    scheduler = MemcacheBackend(replace(settings, lookup_only=True), store_factory=factory)
    with pytest.raises(MemcacheUnavailableError, match="one client per process"):
        MemcacheBackend(settings, store_factory=factory)
    scheduler.close()


# -- data paths (fake) --------------------------------------------------------------------------------


def moves(store: FakeDistributedObjectStore) -> list[tuple[str, int]]:
    """The native put / get calls made, with their copy type (``direct``)."""
    return [(name, args[3]) for name, args, _ in store.calls if name.startswith(("batch_put", "batch_get_into"))]


@pytest.mark.parametrize(("parts", "put", "get"), [(1, "batch_put_from", "batch_get_into"),
                                                   (4, "batch_put_from_layers", "batch_get_into_layers")])
def test_each_segment_layout_takes_its_native_call_with_host_copy_types(world, monkeypatch, parts, put, get):
    # In an NPU process (torch_npu loaded) too, segments are host memory unless registered otherwise.
    monkeypatch.setitem(sys.modules, "torch_npu", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(npu=SimpleNamespace(current_device=lambda: 5)))
    backend, store, _ = fake_backend(world)
    assert ("init", (5,), {"init_bm": True}) in store.calls  # the NPU of this process
    bufs, keys = Buffers(8, parts), unique(8)
    backend.register_memory(ctypes.addressof(bufs.src), ctypes.sizeof(bufs.src))
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.OK] * 8
    assert backend.batch_get(keys, bufs.segments(bufs.dst)) == [Status.OK] * 8
    assert bufs.same()
    assert moves(store) == [(put, memcache.H2G), (get, memcache.G2H)]
    backend.close()


def test_segments_in_a_region_registered_as_device_memory_move_with_device_copy_types(world):
    backend, store, _ = fake_backend(world)
    assert backend.segment_memory() == {Memory.HOST, Memory.DEVICE}
    device, host = Buffers(2), Buffers(1)
    backend.register_memory(ctypes.addressof(device.src), ctypes.sizeof(device.src), Memory.DEVICE)
    backend.register_memory(ctypes.addressof(device.dst), ctypes.sizeof(device.dst), Memory.DEVICE)
    keys = unique(3)
    segments = device.segments(device.src) + host.segments(host.src)
    assert backend.batch_put(keys, segments) == [Status.OK] * 3
    assert sorted(moves(store)) == [("batch_put_from", memcache.L2G)] * 1 + [("batch_put_from", memcache.H2G)]
    store.calls.clear()
    mixed = [device.segments(device.dst)[0] + host.segments(host.dst)[0]]  # one key, both kinds
    assert backend.batch_get(keys[:1], mixed) == [Status.ERROR]
    assert moves(store) == []  # refused, never sent
    assert backend.batch_get(keys[:2], device.segments(device.dst)) == [Status.OK] * 2
    assert device.same() and moves(store) == [("batch_get_into", memcache.G2L)]
    backend.close()


def test_lookup_only_backend_answers_host_memory_and_wants_no_registration(world):
    backend, _, _ = fake_backend(world, FakeMetaService(npu=False), lookup_only=True)
    assert backend.segment_memory() == {Memory.HOST} and not backend.wants_registration()
    backend.close()


def test_full_pool_is_no_space(world):
    backend, _, _ = fake_backend(world, FakeMetaService(capacity=3 * 256))
    bufs = Buffers(5)
    assert backend.batch_put(unique(5), bufs.segments(bufs.src)) == [Status.OK] * 3 + [Status.NO_SPACE] * 2


def test_missing_and_wrong_length_gets(world):
    backend, _, _ = fake_backend(world)
    bufs, keys = Buffers(2, parts=2), unique(3)
    assert backend.batch_put(keys[:2], bufs.segments(bufs.src)) == [Status.OK] * 2
    short = bufs.segments(bufs.dst, part=200)  # stored 512 bytes, asks for 400
    assert backend.batch_get([keys[0], keys[2]], [short[0], bufs.segments(bufs.dst)[1]]) == \
        [Status.CORRUPT, Status.MISSING]


@pytest.mark.parametrize("method,code,status", [
    ("batch_put_from", -3006, Status.EXISTS),
    ("batch_put_from", -3016, Status.NO_SPACE),
    ("batch_put_from", -3013, Status.NO_SPACE),
    ("batch_put_from", -3000, Status.ERROR),
    ("batch_put_from", -3001, Status.ERROR),
    ("batch_get_into", -3106, Status.CORRUPT),
    ("batch_get_into", -3101, Status.MISSING),
    ("batch_get_into", -3102, Status.MISSING),
    ("batch_get_into", -1, Status.ERROR),  # the key is there, with the right length: the copy failed
    ("batch_get_into", -3001, Status.ERROR),
])
def test_every_code_maps_to_a_status(world, method, code, status):
    backend, store, _ = fake_backend(world)
    bufs, key = Buffers(1), unique(1)
    if method == "batch_get_into":
        assert backend.batch_put(key, bufs.segments(bufs.src)) == [Status.OK]
    store.script[method] = [[code]]
    call = backend.batch_put if method == "batch_put_from" else backend.batch_get
    assert call(key, bufs.segments(bufs.dst)) == [status]


def test_refused_batch_answered_with_a_short_list(world):
    backend, store, meta = fake_backend(world)
    bufs, keys = Buffers(3), unique(3)
    assert backend.batch_put(keys[:1], bufs.segments(bufs.src)[:1]) == [Status.OK]
    store.script["batch_get_into"] = [[-3000]]  # source: an over-long batch gets {MMC_INVALID_PARAM}
    assert backend.batch_get(keys, bufs.segments(bufs.dst)) == [Status.ERROR, Status.MISSING, Status.MISSING]
    store.script["batch_put_from"] = [[-3000]]
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.ERROR] * 3


def test_batches_are_chunked(world):
    backend, store, _ = fake_backend(world)
    n = 2 * CHUNK + 7
    assert backend.batch_exists(unique(n)) == [False] * n
    sizes = [len(c[1][0]) for c in store.calls if c[0] == "batch_is_exist"]
    assert sizes == [CHUNK, CHUNK, 7]
    assert backend.batch_exists([]) == [] and backend.batch_put([], []) == []


def test_register_memory(world):
    backend, store, _ = fake_backend(world)
    backend.register_memory(0x10000, 8192)
    backend.register_memory(0x10000 + 4096, 1024)  # inside: nothing to do
    assert store.registered == [(0x10000, 8192)]
    store.script["register_buffer"] = [[-1]]
    with pytest.raises(RuntimeError, match="register_buffer"):
        backend.register_memory(0x40000, 4096)


def test_dead_meta_service_costs_a_deadline_then_nothing(world):
    # probe_interval=0: every call probes the meta service's port while it is down.
    port, _ = world
    meta = FakeMetaService()
    backend, store, _ = fake_backend(world, meta, call_timeout=0.1, probe_interval=0.0)
    bufs, keys = Buffers(2), unique(2)
    port.down()
    meta.down = True
    # The client blocks (60 s in the library, until release() here): the call returns at its deadline.
    assert backend.batch_exists(keys) == [False, False]
    assert meta.wait_stuck(1)  # still blocked in the client after the call returned
    calls = len(store.calls)
    assert backend.batch_get(keys, bufs.segments(bufs.dst)) == [Status.ERROR] * 2
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.ERROR] * 2
    assert backend.batch_exists(keys) == [False, False]
    assert len(store.calls) == calls  # answered without the client
    meta.release()
    assert meta.wait_stuck(0)
    # The meta service comes back: the next call's probe sees it, and calls reach the client again.
    port.up()
    meta.down, store.link_lost = False, False
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.OK] * 2
    backend.close()


def test_close(world):
    backend, store, _ = fake_backend(world)
    backend.close()
    backend.close()
    assert [c[0] for c in store.calls].count("close") == 1
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_exists(["k"])
    with pytest.raises(RuntimeError, match="closed"):
        backend.register_memory(0x1000, 1)


def test_close_leaves_a_stuck_client_alone(world):
    meta = FakeMetaService()
    backend, store, _ = fake_backend(world, meta, call_timeout=0.1, close_timeout=0.1)
    meta.down = True
    assert backend.batch_exists(["k"]) == [False]
    assert meta.wait_stuck(1)  # the client call is still stuck
    backend.close()  # must not free the client under it (the fake raises NativeCrash on a call after close)
    assert "close" not in [c[0] for c in store.calls]
    meta.release()
    assert meta.wait_stuck(0)


# -- the real library ---------------------------------------------------------------------------------

_SIG_RE = re.compile(r"^(\w+)\((.*)\) -> (.+)$")


def doc_signature(method) -> tuple[inspect.Signature, str]:
    """The signature pybind11 writes as the first docstring line, and its return annotation."""
    first = (method.__doc__ or "").strip().splitlines()[0]
    m = _SIG_RE.match(first)
    assert m, f"unexpected docstring {first!r}"
    params, depth, cur = [], 0, ""
    for ch in m.group(2):
        depth += ch in "[<(" and 1 or ch in "]>)" and -1 or 0
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    params.append(cur.strip())
    out = []
    for p in params[1:]:  # self first
        name, _, rest = p.partition(":")
        default = inspect.Parameter.empty
        if " = " in rest:
            raw = rest.split(" = ", 1)[1].strip()
            default = int(raw) if re.fullmatch(r"-?\d+", raw) else (raw == "True" if raw in ("True", "False") else raw)
        out.append(inspect.Parameter(name.strip(), inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    return inspect.Signature(out), m.group(3).strip()


RETURNS = {"init": "int", "close": "int", "register_buffer": "int", "batch_get_key_info": "list[_pymmc.KeyInfo]"}


def test_real_class_has_what_the_backend_and_the_fake_use():
    mc = require_memcache()
    real = mc.DistributedObjectStore
    for name in STORE_METHODS:
        assert hasattr(real, name), f"memcache_hybrid.DistributedObjectStore lost {name}"
        sig, returns = doc_signature(getattr(real, name))
        assert returns == RETURNS.get(name, "list[int]"), (name, returns)
        fake = inspect.signature(getattr(FakeDistributedObjectStore, name))
        fake_params = list(fake.parameters.values())[1:]
        assert [p.name for p in fake_params] == list(sig.parameters), name
        for p in fake_params:
            real_default = sig.parameters[p.name].default
            if isinstance(real_default, (int, bool)) or real_default is inspect.Parameter.empty:
                assert p.default == real_default, (name, p.name, p.default, real_default)
    from memfabric_hybrid import bm

    copy = bm.BmCopyType
    assert (int(copy.L2G), int(copy.G2L), int(copy.G2H), int(copy.H2G)) == (
        memcache.L2G, memcache.G2L, memcache.G2H, memcache.H2G)


def test_every_call_the_backend_makes_binds_to_the_real_signature(world):
    mc = require_memcache()
    backend, store, _ = fake_backend(world)
    for parts in (1, 3):
        bufs, keys = Buffers(4, parts), unique(5)
        backend.register_memory(ctypes.addressof(bufs.src), ctypes.sizeof(bufs.src))
        backend.batch_put(keys[:4], bufs.segments(bufs.src))
        backend.batch_exists(keys)
        backend.batch_get(keys[:4], bufs.segments(bufs.dst))
        backend.batch_get(keys[1:], bufs.segments(bufs.dst, part=100))  # diagnose: exist + key info
    backend.close()
    made = {c[0] for c in store.calls}
    assert made == set(STORE_METHODS), made ^ set(STORE_METHODS)
    for name, args, kwargs in store.calls:
        sig, _ = doc_signature(getattr(mc.DistributedObjectStore, name))
        sig.bind(*args, **kwargs)  # TypeError if the real method would refuse the call


# Real meta service: one per host (the library locks /tmp/mmc_meta_service.lock), on free loopback ports.

META_MAIN = "from memcache_hybrid import MetaService; import sys; sys.exit(MetaService.main())"


@dataclass
class MetaServiceProc:
    conf: Path  # a local config file that points to the meta service
    proc: subprocess.Popen


@pytest.fixture
def meta_service(tmp_path: Path) -> Iterator[MetaServiceProc]:
    """A real meta service on loopback, stopped after the test."""
    require_memcache()
    port, store_port = free_port(), free_port()
    conf = tmp_path / "mmc-meta.conf"
    conf.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{port}\n"
        f"ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:{store_port}\n"
        f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{free_port()}\n"
        f"ock.mmc.log_level = error\nock.mmc.log_path = {tmp_path / 'meta-log'}\n"
    )
    log = open(tmp_path / "meta.out", "w")
    proc = subprocess.Popen([sys.executable, "-c", META_MAIN], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "MMC_META_CONFIG_PATH": str(conf)}, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    else:
        proc.kill()
        proc.wait()
        out = (tmp_path / "meta.out").read_text()[-2000:]
        if "lock file is locked" in out:  # one meta service per host: /tmp/mmc_meta_service.lock
            skip_or_fail(f"another Memcache meta service runs on this host: {out}")
        pytest.fail(f"the Memcache meta service did not start within 60 s: {out}")
    try:
        yield MetaServiceProc(write_local_conf(tmp_path / "mmc-local.conf", port, store_port), proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def run_real(code: str, conf: Path, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter (a native crash must fail the test, not kill pytest)."""
    prog = "import json, os, sys, time, ctypes\n" + textwrap.dedent(code)
    env = {**os.environ, "MMC_LOCAL_CONFIG_PATH": str(conf),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# The same calls for the real client and the fake: a lookup-only client, a pool with no memory.
REPLAY = """
def replay(store):
    buf = ctypes.create_string_buffer(4096)
    a = ctypes.addressof(buf)
    out = {}
    out["init"] = store.init(0, init_bm=False)
    out["exist_empty"] = store.batch_is_exist([])
    out["exist"] = store.batch_is_exist(["a", "b"])
    out["exist_256"] = store.batch_is_exist(["x" * 256])
    out["exist_257"] = store.batch_is_exist(["x" * 257])
    out["put"] = store.batch_put_from(["a"], [a], [64], 3)
    out["put_device"] = store.batch_put_from(["a"], [a], [64], 0)
    out["put_auto"] = store.batch_put_from(["a"], [a], [64], 9)
    out["put_size0"] = store.batch_put_from(["a"], [a], [0], 3)
    out["put_mismatch"] = store.batch_put_from(["a", "b"], [a], [64], 3)
    out["put_257"] = store.batch_put_from(["x" * 257], [a], [64], 3)
    out["get"] = store.batch_get_into(["a", "b"], [a, a + 64], [64, 64], 2)
    out["get_bad_direct"] = store.batch_get_into(["a"], [a], [64], 3)
    out["get_mismatch"] = store.batch_get_into(["a", "b"], [a], [64], 2)
    out["put_layers"] = store.batch_put_from_layers(["a"], [[a, a + 64]], [[64, 64]], 3)
    out["put_layers_auto"] = store.batch_put_from_layers(["a"], [[a, a + 64]], [[64, 64]], 9)
    out["put_layers_bad_direct"] = store.batch_put_from_layers(["a"], [[a, a + 64]], [[64, 64]], 1)
    out["get_layers"] = store.batch_get_into_layers(["a"], [[a, a + 64]], [[64, 64]], 2)
    out["get_layers_empty"] = store.batch_get_into_layers(["a"], [[]], [[]], 2)
    out["key_info"] = [i.size() for i in store.batch_get_key_info(["a", "b"])]
    out["close"] = store.close()
    return out
"""


def test_fake_matches_real_library(meta_service):
    real = run_real(REPLAY + """
from memcache_hybrid import DistributedObjectStore
print("RESULT " + json.dumps(replay(DistributedObjectStore())), flush=True)
os._exit(0)
""", meta_service.conf)
    ns: dict = {"ctypes": ctypes}
    exec(REPLAY, ns)
    fake = ns["replay"](FakeDistributedObjectStore(FakeMetaService(capacity=0, npu=False)))
    assert real["init"] == 0, real
    assert fake == real


def test_real_worker_backend_names_the_driver_check(meta_service):
    if any(os.path.exists(p) for p in memcache.DRIVER_FILES):
        pytest.skip("this host has an Ascend driver: the worker's client may start here")
    out = run_real("""
from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings, MemcacheUnavailableError
t = time.monotonic()
try:
    MemcacheBackend(MemcacheSettings.load())
    result = {"error": None}
except MemcacheUnavailableError as e:
    result = {"error": str(e)}
result["seconds"] = time.monotonic() - t
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
""", meta_service.conf)
    assert out["error"] and "the Ascend driver check" in out["error"], out
    assert "init hybm failed" in out["error"], out  # memfabric's own last error, passed on
    assert out["seconds"] < 30


def test_real_lookup_only_backend_works_without_an_npu(meta_service):
    out = run_real("""
import dataclasses
from memcache_hybrid import DistributedObjectStore
from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings
stores = []
def factory():
    stores.append(DistributedObjectStore())
    return stores[-1]
settings = dataclasses.replace(MemcacheSettings.load(), lookup_only=True)
b = MemcacheBackend(settings, store_factory=factory)
result = {"exists": b.batch_exists(["a", "b"]), "many": sum(b.batch_exists([f"k{i}" for i in range(1500)]))}
other = MemcacheBackend(settings, store_factory=factory)  # shares the process's client; closing it must not end b's
other.close()
result["raw_after_other_closed"] = stores[0].batch_is_exist(["a"])  # -3019 if the client were gone
result["clients"] = len(stores)
b.close()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
""", meta_service.conf)
    assert out == {"exists": [False, False], "many": 0, "raw_after_other_closed": [0], "clients": 1}


def test_real_dead_meta_service_costs_the_deadline_not_60s(meta_service):
    # The child waits on its stdin while the meta service is killed; then its
    # first call returns at the deadline (1 s; the library blocks 60 s) and
    # the second answers without calling the client.
    child = """
import dataclasses, json, sys
from memcache_hybrid import DistributedObjectStore
from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings

class Counting(DistributedObjectStore):
    calls = 0
    def batch_is_exist(self, keys):
        Counting.calls += 1
        return super().batch_is_exist(keys)

b = MemcacheBackend(dataclasses.replace(MemcacheSettings.load(), lookup_only=True), call_timeout=1.0,
                    store_factory=Counting)
assert b.batch_exists(["a"]) == [False]
print("READY", flush=True)
sys.stdin.readline()
first = b.batch_exists(["a", "b"]); after_first = Counting.calls
second = b.batch_exists(["a", "b"])
print("RESULT " + json.dumps({"first": first, "second": second, "calls": [after_first, Counting.calls]}), flush=True)
os._exit(0)
"""
    env = {**os.environ, "MMC_LOCAL_CONFIG_PATH": str(meta_service.conf),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", "import os\n" + child], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        said = read_until(proc.stdout, "READY", timeout=120)  # the child started its client
        assert said[-1:] and said[-1].startswith("READY"), "".join(said)[-3000:]
        meta_service.proc.kill()  # the meta service dies without a goodbye
        meta_service.proc.wait()
        out, _ = proc.communicate("go\n", timeout=30)  # a guard: the library alone would block 60 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["first"] == [False, False] and result["second"] == [False, False], result
    assert result["calls"][1] == result["calls"][0], result  # the second call never reached the client


def read_until(stream, prefix: str, timeout: float) -> list[str]:
    """Lines of ``stream`` up to the first that starts with ``prefix`` (or its end); fails after ``timeout``."""
    lines: list[str] = []

    def read() -> None:
        for line in iter(stream.readline, ""):
            lines.append(line)
            if line.startswith(prefix):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"no {prefix!r} within {timeout} s: {''.join(lines)[-3000:]}"
    return lines
