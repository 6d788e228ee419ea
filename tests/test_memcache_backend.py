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
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from memcache_fake import FakeDistributedObjectStore, FakeMetaService
from vllm_aio.backends import memcache
from vllm_aio.backends.base import Status
from vllm_aio.backends.memcache import (
    CHUNK,
    INSTALL_HINT,
    STORE_METHODS,
    MemcacheBackend,
    MemcacheSettings,
    MemcacheUnavailableError,
    import_store,
)
from vllm_aio.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(n: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}-{i}" for i in range(n)]


# -- the fake's world: a TCP port that answers like a meta service, a config file --------------


class FakeMetaPort:
    """A listening socket, so the backend's TCP probe sees a meta service."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock: socket.socket | None = None
        self.up()

    def up(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)

    def down(self) -> None:
        self.sock.close()


def write_local_conf(path: Path, meta_port: int, store_port: int, protocol: str = "host_tcp") -> Path:
    path.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{meta_port}\n"
        f"ock.mmc.local_service.config_store_url = tcp://127.0.0.1:{store_port}\n"
        f"# a comment line\nock.mmc.local_service.protocol = {protocol}\n"
        "ock.mmc.local_service.dram.size = 64MB\nock.mmc.local_service.hbm.size = 0\nock.mmc.log_level = error\n"
    )
    return path


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[FakeMetaPort, Path]]:
    port = FakeMetaPort()
    yield port, write_local_conf(tmp_path / "mmc-local.conf", port.port, port.port)
    port.down()


def fake_backend(world, meta: FakeMetaService | None = None, lookup_only: bool = False, **kwargs):
    _, conf = world
    meta = meta or FakeMetaService()
    store = FakeDistributedObjectStore(meta)
    settings = MemcacheSettings.load({"memory": "host"}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
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
    assert (s.config_path, s.protocol, s.device_id, s.memory) == (str(conf), "host_tcp", None, None)
    assert s.meta_service_url.startswith("tcp://127.0.0.1:")
    s = MemcacheSettings.load({"device_id": 3, "memory": "device"}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert (s.device_id, s.memory) == (3, "device")


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
    with pytest.raises(ConfigError, match="memory"):
        MemcacheSettings.load({"memory": "npu"}, environ=env(conf))


def test_import_failure_names_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)
    with pytest.raises(MemcacheUnavailableError, match=re.escape(INSTALL_HINT)):
        import_store()


# -- construction ---------------------------------------------------------------------------------


def test_unreachable_meta_service_fails_fast(world):
    port, _ = world
    port.down()
    t = time.monotonic()
    with pytest.raises(MemcacheUnavailableError, match="unreachable"):
        fake_backend(world, connect_timeout=0.5)
    assert time.monotonic() - t < 2
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

    settings = MemcacheSettings.load({"memory": "host"}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
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


@pytest.mark.parametrize("parts", [1, 4])
def test_roundtrip(world, parts):
    backend, store, _ = fake_backend(world)
    bufs, keys = Buffers(8, parts), unique(8)
    backend.register_memory(ctypes.addressof(bufs.src), ctypes.sizeof(bufs.src))
    assert backend.batch_exists(keys) == [False] * 8
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.OK] * 8
    assert backend.batch_exists(keys) == [True] * 8
    assert backend.batch_get(keys, bufs.segments(bufs.dst)) == [Status.OK] * 8
    assert bufs.same()
    used = {c[0] for c in store.calls}
    assert ({"batch_put_from", "batch_get_into"} if parts == 1 else
            {"batch_put_from_layers", "batch_get_into_layers"}) <= used
    backend.close()


def test_put_of_existing_key_keeps_the_old_value(world):
    backend, _, meta = fake_backend(world)
    a, b = Buffers(1), Buffers(1)
    b.src[0] = (a.src[0] + 1) % 256
    key = unique(1)
    assert backend.batch_put(key, a.segments(a.src)) == [Status.OK]
    assert backend.batch_put(key, b.segments(b.src)) == [Status.OK]  # the binding reports 0
    assert backend.batch_get(key, a.segments(a.dst)) == [Status.OK] and a.same()


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
    port, _ = world
    meta = FakeMetaService()
    meta.hang_s = 3.0
    backend, store, _ = fake_backend(world, meta, call_timeout=0.3)
    bufs, keys = Buffers(2), unique(2)
    port.down()
    meta.down = True
    t = time.monotonic()
    assert backend.batch_exists(keys) == [False, False]
    assert time.monotonic() - t < 1.5
    calls = len(store.calls)
    t = time.monotonic()
    assert backend.batch_get(keys, bufs.segments(bufs.dst)) == [Status.ERROR] * 2
    assert backend.batch_put(keys, bufs.segments(bufs.src)) == [Status.ERROR] * 2
    assert time.monotonic() - t < 0.2 and len(store.calls) == calls  # answered without the client
    # The meta service comes back: after the probe interval, calls reach the client again.
    port.up()
    meta.down, store.link_lost = False, False
    time.sleep(0.6)
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
    port, _ = world
    meta = FakeMetaService()
    meta.hang_s = 1.5
    backend, store, _ = fake_backend(world, meta, call_timeout=0.1, close_timeout=0.2)
    meta.down = True
    assert backend.batch_exists(["k"]) == [False]  # the client call is still stuck
    backend.close()  # must not free the client under it (the fake raises NativeCrash on a call after close)
    assert "close" not in [c[0] for c in store.calls]
    time.sleep(1.6)


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
from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings
settings = dataclasses.replace(MemcacheSettings.load(), lookup_only=True)
b = MemcacheBackend(settings)
result = {"exists": b.batch_exists(["a", "b"]), "many": sum(b.batch_exists([f"k{i}" for i in range(1500)]))}
other = MemcacheBackend(settings)  # shares the process's client; closing it must not end b's
other.close()
result["raw_after_other_closed"] = b._store.batch_is_exist(["a"])  # -3019 if the client were gone
b.close()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
""", meta_service.conf)
    assert out == {"exists": [False, False], "many": 0, "raw_after_other_closed": [0]}


def test_real_dead_meta_service_costs_the_deadline_not_60s(meta_service, tmp_path):
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc_code = f"""
import dataclasses, pathlib
from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings
b = MemcacheBackend(dataclasses.replace(MemcacheSettings.load(), lookup_only=True), call_timeout=1.0)
assert b.batch_exists(["a"]) == [False]
pathlib.Path({str(ready)!r}).touch()
while not pathlib.Path({str(go)!r}).exists():
    time.sleep(0.05)
t = time.monotonic(); first = b.batch_exists(["a", "b"]); t1 = time.monotonic() - t
t = time.monotonic(); second = b.batch_exists(["a", "b"]); t2 = time.monotonic() - t
print("RESULT " + json.dumps({{"first": first, "t1": t1, "second": second, "t2": t2}}), flush=True)
os._exit(0)
"""
    env = {**os.environ, "MMC_LOCAL_CONFIG_PATH": str(meta_service.conf),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", "import json, os, time\n" + proc_code],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate(timeout=10)[0][-3000:]
    meta_service.proc.kill()  # the meta service dies without a goodbye
    meta_service.proc.wait()
    go.touch()
    out, _ = proc.communicate(timeout=60)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, out[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["first"] == [False, False] and result["second"] == [False, False]
    assert result["t1"] < 3.0 and result["t2"] < 0.5, result
