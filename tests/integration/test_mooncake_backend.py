"""MooncakeBackend against a real mooncake_master and memory owner on loopback.

The statuses asserted here are what Mooncake 0.3.13 really does (see the module
docstring of ``vllm_aio.backends.mooncake``), including where it differs from
what one would guess: a put of an existing key succeeds with code 0 and keeps
the old value, and a get into a wrong-sized destination fails with -600/-800
rather than returning a short byte count. What every backend does (round
trips, missing keys, repeated keys, close) is in ``test_backend_contract.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from vllm_aio.backends import open_backend
from vllm_aio.backends.base import Status
from vllm_aio.backends.mooncake import (
    INSTALL_HINT,
    STAGING_SIZE,
    MooncakeBackend,
    MooncakeSettings,
    MooncakeUnavailableError,
    get_status,
    import_store,
    put_status,
)
from vllm_aio.config import parse_extra_config
from vllm_aio.devtools.mooncake_pool import CLIENT_TTL, MooncakePool, free_port
from vllm_aio.errors import ConfigError
from vllm_aio.pool.keys import BlockParts

pytest_plugins = ["harness.mooncake_fixtures"]

SEGMENTS_PER_KEY = 4
SEGMENT = 4096


def unique(n: int = 1) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}-{i}" for i in range(n)]


class Blocks:
    """A source and a destination tensor, registered, carved into scattered segments.

    Key i's value is segments i, i+n, i+2n, ... of the tensor (like a block's
    bytes spread over layers), so the segments of one key are not adjacent.
    """

    def __init__(self, backend: MooncakeBackend, n: int, parts: int = SEGMENTS_PER_KEY, part: int = SEGMENT):
        self.n, self.parts, self.part = n, parts, part
        gen = torch.Generator().manual_seed(n)
        self.src = torch.randint(0, 256, (n * parts * part,), dtype=torch.uint8, generator=gen)
        self.dst = torch.zeros_like(self.src)
        backend.register_memory(self.src.data_ptr(), self.src.numel())
        backend.register_memory(self.dst.data_ptr(), self.dst.numel())

    def segments(self, tensor: torch.Tensor) -> list[list[tuple[int, int]]]:
        base = tensor.data_ptr()
        return [[(base + (j * self.n + i) * self.part, self.part) for j in range(self.parts)]
                for i in range(self.n)]

    def equal(self, i: int) -> bool:
        idx = [(j * self.n + i) * self.part for j in range(self.parts)]
        return all(torch.equal(self.src[o:o + self.part], self.dst[o:o + self.part]) for o in idx)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread; fail if it has not returned after ``seconds`` (a guard, not a timing)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"call still running after {seconds} s"
    result, error = box[0]
    if error is not None:
        raise error
    return result


def _outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
        return None, e


class RecordingStore:
    """The real client, recording every method called on it; ``hide``: methods it
    pretends not to have (as an older client would)."""

    def __init__(self, hide: Sequence[str] = ()) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        self.hide = frozenset(hide)
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str) -> Any:
        if name in self.hide:
            raise AttributeError(name)
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return method(*args)

        return call

    def made(self, prefix: str = "") -> list[tuple[str, tuple]]:
        return [c for c in self.calls if c[0].startswith(prefix)]


@pytest.fixture(scope="module")
def recorded(mooncake_settings: MooncakeSettings) -> Iterator[tuple[MooncakeBackend, RecordingStore]]:
    """A backend on the session pool whose client records its calls; shared, do not close it."""
    store = RecordingStore()
    backend = MooncakeBackend(mooncake_settings, store_factory=lambda: store)
    yield backend, store
    backend.close()


# -- against the session pool ---------------------------------------------------


@pytest.mark.parametrize(("parts", "part", "path"), [(1, 4096, "single"), (4, 4096, "staged"), (4, 65536, "multi")])
def test_each_segment_layout_takes_its_native_call(
    recorded: tuple[MooncakeBackend, RecordingStore], parts: int, part: int, path: str
) -> None:
    # Over tcp, small segments are gathered into a registered staging buffer first.
    backend, store = recorded
    keys = unique(8)
    blocks = Blocks(backend, len(keys), parts=parts, part=part)
    store.calls.clear()
    assert backend.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 8
    assert backend.batch_get(keys, blocks.segments(blocks.dst)) == [Status.OK] * 8
    assert torch.equal(blocks.src, blocks.dst)
    [(put, args)] = store.made("batch_put")
    if path == "multi":
        assert put == "batch_put_from_multi_buffers"
    else:
        assert put == "batch_put_from"
        from_cache = args[1] == [segs[0][0] for segs in blocks.segments(blocks.src)]
        assert from_cache == (path == "single")


def test_round_trip_without_multi_buffer_api(mooncake_settings: MooncakeSettings) -> None:
    # As on a client without batch_*_multi_buffers: keys of several large
    # segments go through the staging buffer too.
    store = RecordingStore(hide=("batch_put_from_multi_buffers", "batch_get_into_multi_buffers"))
    backend = MooncakeBackend(mooncake_settings, store_factory=lambda: store)
    try:
        keys = unique(6)
        blocks = Blocks(backend, len(keys), parts=3, part=65536)
        assert backend.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 6
        assert backend.batch_get(keys, blocks.segments(blocks.dst)) == [Status.OK] * 6
        assert torch.equal(blocks.src, blocks.dst)
        assert [name for name, _ in store.made("batch_")] == ["batch_put_from", "batch_get_into"]
        assert [args[1] for _, args in store.made("register_buffer")][-1] == STAGING_SIZE
    finally:
        backend.close()


def test_put_existing_key_keeps_old_value(mooncake_backend: MooncakeBackend) -> None:
    # Mooncake answers 0 (not -705) and keeps the first value: reported as OK.
    [key] = unique()
    blocks = Blocks(mooncake_backend, 1)
    first = blocks.src.clone()
    assert mooncake_backend.batch_put([key], blocks.segments(blocks.src)) == [Status.OK]
    blocks.src.fill_(7)
    [status] = mooncake_backend.batch_put([key], blocks.segments(blocks.src))
    assert status.stored and status is Status.OK
    assert mooncake_backend.batch_get([key], blocks.segments(blocks.dst)) == [Status.OK]
    assert torch.equal(blocks.dst, first)


@pytest.mark.parametrize("part", [4096, 65536])  # staged, multi-buffer
def test_get_wrong_total_size_is_corrupt(mooncake_backend: MooncakeBackend, part: int) -> None:
    # Opened without value_bytes: the store's own codes (-600 / -800) tell the mismatch.
    keys = unique(3)
    blocks = Blocks(mooncake_backend, 3, part=part)
    assert mooncake_backend.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 3
    segs = blocks.segments(blocks.dst)
    shorter = segs[0][:-1]  # store answers -600: destination too small
    longer = segs[1] + [(blocks.dst.data_ptr(), 64)]  # multi: -800 (TRANSFER_FAIL); single: short count
    statuses = mooncake_backend.batch_get(keys, [shorter, longer, segs[2]])
    assert statuses == [Status.CORRUPT, Status.CORRUPT, Status.OK]
    assert blocks.equal(2)


def test_engine_without_memory_uses_the_standalone_owner(mooncake_settings: MooncakeSettings) -> None:
    # Both engines contribute no memory: the value lives in the pool's own
    # client and survives the engine that stored it.
    assert mooncake_settings.global_segment_size == 0
    keys = unique(4)
    writer = MooncakeBackend(mooncake_settings)
    blocks = Blocks(writer, 4)
    assert writer.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 4
    writer.close()
    reader = MooncakeBackend(mooncake_settings)
    try:
        reader.register_memory(blocks.dst.data_ptr(), blocks.dst.numel())
        assert reader.batch_get(keys, blocks.segments(blocks.dst)) == [Status.OK] * 4
        assert torch.equal(blocks.src, blocks.dst)
    finally:
        reader.close()


# -- private pools ----------------------------------------------------------------


def test_pool_full_is_no_space(mooncake_pool_factory: Callable[..., MooncakePool]) -> None:
    pool = mooncake_pool_factory("16MB")  # mooncake_client's smallest segment
    backend = MooncakeBackend(MooncakeSettings.load(pool.config, environ={}))
    try:
        keys = unique(24)
        blocks = Blocks(backend, 24, parts=4, part=256 << 10)  # 24 x 1 MiB into 16 MiB
        statuses = backend.batch_put(keys, blocks.segments(blocks.src))
        assert Status.NO_SPACE in statuses
        assert set(statuses) <= {Status.OK, Status.NO_SPACE}
    finally:
        backend.close()


def test_master_killed_mid_run_fails_then_answers_without_the_client(
    mooncake_pool_factory: Callable[..., MooncakePool],
) -> None:
    # With the master gone each client call blocks ~4 s: once a call has
    # failed, calls answer ERROR without reaching the client.
    pool = mooncake_pool_factory()
    store = RecordingStore()
    backend = MooncakeBackend(MooncakeSettings.load(pool.config, environ={}), store_factory=lambda: store)
    try:
        keys = unique(4)
        blocks = Blocks(backend, 4)
        assert backend.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 4
        pool.kill_master()
        statuses = within(30, lambda: backend.batch_get(keys, blocks.segments(blocks.dst)))
        assert set(statuses) <= {Status.ERROR, Status.MISSING}
        calls = len(store.calls)
        for _ in range(3):
            assert set(backend.batch_get(keys, blocks.segments(blocks.dst))) <= {Status.ERROR, Status.MISSING}
            assert backend.batch_put(unique(2), blocks.segments(blocks.src)[:2]) == [Status.ERROR] * 2
            assert backend.batch_exists(keys) == [False] * 4
        assert len(store.calls) == calls
    finally:
        within(30, backend.close)


def test_memory_owner_killed_gets_fail_bounded(mooncake_pool_factory: Callable[..., MooncakePool]) -> None:
    pool = mooncake_pool_factory()
    backend = MooncakeBackend(MooncakeSettings.load(pool.config, environ={}))
    try:
        keys = unique(2)
        blocks = Blocks(backend, 2)
        assert backend.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 2
        pool.kill_client()
        statuses = within(30, lambda: backend.batch_get(keys, blocks.segments(blocks.dst)))
        assert set(statuses) <= {Status.ERROR, Status.MISSING}
    finally:
        backend.close()


def test_dev_pool_master_keeps_a_silent_client_for_a_minute(mooncake_pool_factory: Callable[..., MooncakePool]) -> None:
    # Mooncake's default of 10 s lost the pool when TP workers starved the memory owner.
    pool = mooncake_pool_factory()
    assert CLIENT_TTL >= 60
    assert f"client_ttl={CLIENT_TTL}," in (pool.log_dir / "master.log").read_text()


def test_dev_pool_master_restarted_from_a_thread_outlives_the_thread(
    mooncake_pool_factory: Callable[..., MooncakePool]
) -> None:
    # The children die with the thread that forked them (PR_SET_PDEATHSIG): a master restarted
    # from a load's client thread died when the load ended, and the next test ran without one.
    pool = mooncake_pool_factory()
    pool.kill_master()
    restarter = threading.Thread(target=pool.restart_master)
    restarter.start()
    restarter.join(60)
    assert not restarter.is_alive()
    with contextlib.suppress(subprocess.TimeoutExpired):
        pool.master.wait(2)  # a SIGTERM on the thread's end would have taken it by now
    assert pool.alive()


def tenant_pool(factory: Callable[..., MooncakePool], tmp_path: Any, tenants: tuple[str, ...]) -> MooncakePool:
    """A pool whose master keeps the tenants' keys apart (puts of tenants it does not name fail)."""
    quota = tmp_path / "tenants.yaml"
    quota.write_text("version: 1\ntenants:\n" + "".join(f"  - name: {t}\n    quota: 32MB\n" for t in tenants))
    return factory(master_args=("--enable_multi_tenants=true", f"--tenant_quota_connector_uri={quota}"))


def open_client(pool: MooncakePool, tenant: str, for_scheduler: bool) -> MooncakeBackend:
    """A client as the connector opens it, from inline settings, for values of ``Blocks``."""
    cfg = parse_extra_config({"backend": "mooncake", **pool.config, "tenant_id": tenant}, environ={})
    backend = open_backend(cfg.backend_settings, "unused", SEGMENTS_PER_KEY * SEGMENT, for_scheduler=for_scheduler)
    assert isinstance(backend, MooncakeBackend)
    return backend


def test_scheduler_client_keeps_the_workers_tenant(
    mooncake_pool_factory: Callable[..., MooncakePool], tmp_path: Any
) -> None:
    pool = tenant_pool(mooncake_pool_factory, tmp_path, ("a", "b"))
    worker, scheduler, other = (open_client(pool, "a", False), open_client(pool, "a", True),
                                open_client(pool, "b", True))
    try:
        keys = unique(2)
        blocks = Blocks(worker, len(keys))
        assert worker.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK] * 2
        assert scheduler.batch_exists(keys) == [True, True]
        assert other.batch_exists(keys) == [False, False]
    finally:
        for backend in (worker, scheduler, other):
            backend.close()


def test_tenants_see_none_of_each_others_keys_on_a_master_without_multi_tenants(
    mooncake_pool_factory: Callable[..., MooncakePool],
) -> None:
    # Mooncake 0.3.13 shares keys between tenants unless the master enforces
    # tenants; the backend keeps each tenant's keys in a key space of its own.
    pool = mooncake_pool_factory()
    writer, reader, default = open_client(pool, "a", False), open_client(pool, "b", True), open_client(
        pool, "default", True
    )
    try:
        keys = unique()
        blocks = Blocks(writer, 1)
        assert writer.batch_put(keys, blocks.segments(blocks.src)) == [Status.OK]
        assert reader.batch_exists(keys) == [False]
        assert default.batch_exists(keys) == [False]
        assert writer.batch_exists(keys) == [True]
    finally:
        for backend in (writer, reader, default):
            backend.close()


def test_unreachable_master_fails_setup_without_its_retries() -> None:
    # Checked before setup, whose retries against a dead master take ~90 s.
    address = f"127.0.0.1:{free_port()}"
    settings = MooncakeSettings.load({"master_server_address": address}, environ={})
    with pytest.raises(MooncakeUnavailableError, match=address):
        within(30, lambda: MooncakeBackend(settings))


def first_line(stream: Any, prefix: bytes) -> str | None:
    """The first line of ``stream`` that starts with ``prefix``; None at its end."""
    for line in iter(stream.readline, b""):
        if line.startswith(prefix):
            return line.decode()
    return None


def test_cli_pool_writes_config_and_stops_on_sigterm(tmp_path: Any) -> None:
    from harness.mooncake_fixtures import require_mooncake

    require_mooncake()
    out = tmp_path / "mooncake.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_aio.cli", "serve-mooncake", "--size", "32MB", "--config-out", str(out),
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        # The CLI says "# pool of ... up" on stderr once the pool runs and the file is written.
        said = within(60, lambda: first_line(proc.stderr, b"# pool of"))
        assert said is not None and out.exists(), f"the CLI exited with {proc.wait()}"
        config = json.loads(out.read_text())
        settings = MooncakeSettings.load({}, environ={"MOONCAKE_CONFIG_PATH": str(out)})
        assert settings.master_server_address == config["master_server_address"]
        backend = MooncakeBackend(settings)
        blocks = Blocks(backend, 1)
        assert backend.batch_put(unique(), blocks.segments(blocks.src)) == [Status.OK]
        backend.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert json.loads(proc.stdout.read().decode()) == config


# -- settings and code mapping (no master needed) ---------------------------------


def test_settings_file_inline_env_precedence(tmp_path: Any) -> None:
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({
        "master_server_address": "10.0.0.1:50051", "protocol": "rdma", "device_name": "mlx5_0",
        "global_segment_size": "4GB", "local_buffer_size": 1 << 20,
    }))
    settings = MooncakeSettings.load(
        {"protocol": "tcp", "local_hostname": "10.0.0.2"},
        environ={"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "10.0.0.9:6000",
                 "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512MB"},
    )
    assert settings == MooncakeSettings(
        master_server_address="10.0.0.9:6000", local_hostname="10.0.0.2", metadata_server="P2PHANDSHAKE",
        protocol="tcp", device_name="mlx5_0", global_segment_size=512 << 20, local_buffer_size=1 << 20,
    )


def test_settings_defaults_and_zero_sizes() -> None:
    settings = MooncakeSettings.load({"master_server_address": "127.0.0.1:50051", "global_segment_size": "0GB",
                                      "local_buffer_size": 0}, environ={})
    assert (settings.global_segment_size, settings.local_buffer_size) == (0, 0)
    assert settings.metadata_server == "P2PHANDSHAKE" and settings.protocol == "tcp"
    assert settings.resolved_hostname() == "127.0.0.1"


@pytest.mark.parametrize(
    ("inline", "environ", "match"),
    [
        ({"master_server_address": "h:1", "mode": "x"}, {}, r"unknown key\(s\) mode .*accepted keys: .*protocol"),
        ({}, {}, "master_server_address: missing"),
        ({"master_server_address": "nohost"}, {}, "master_server_address: expected 'host:port'"),
        ({"master_server_address": "h:1", "global_segment_size": "lots"}, {}, "global_segment_size: expected a size"),
        ({"master_server_address": "h:1", "global_segment_size": -1}, {}, "global_segment_size: must be positive"),
        ({"master_server_address": "h:1", "protocol": 3}, {}, "protocol: expected a string"),
        ({"master_server_address": "h:1"}, {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "big"}, "expected a size"),
        ({}, {"MOONCAKE_CONFIG_PATH": "/nonexistent/mc.json"}, "cannot read Mooncake settings from /nonexistent"),
    ],
)
def test_settings_errors(inline: dict[str, Any], environ: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MooncakeSettings.load(inline, environ)


@pytest.mark.parametrize(("text", "match"), [
    ('{"master_server_address": "h:1",', "cannot read Mooncake settings from .*mc.json: Expecting"),
    ('["h:1"]', "must hold a JSON object, got list"),
])
def test_a_malformed_config_file_fails_naming_the_variable_and_the_file(tmp_path: Any, text: str, match: str) -> None:
    path = tmp_path / "mc.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"MOONCAKE_CONFIG_PATH: .*{match}"):
        MooncakeSettings.load({}, {"MOONCAKE_CONFIG_PATH": str(path)})


def test_unknown_key_in_file_names_the_file(tmp_path: Any) -> None:
    environ = settings_file(tmp_path, {"master_server_address": "h:1", "protocl": "tcp"})
    with pytest.raises(ConfigError, match=f"protocl in MOONCAKE_CONFIG_PATH file {environ['MOONCAKE_CONFIG_PATH']}"):
        MooncakeSettings.load({}, environ)


# Files as other connectors read them from MOONCAKE_CONFIG_PATH: vLLM 0.32's
# MooncakeStoreConnector (vllm/distributed/mooncake_store.py) and vllm-ascend's
# AscendStoreConnector (ascend_store/backend/mooncake_backend.py, keys of its versions).
VLLM_FILE = {
    "metadata_server": "P2PHANDSHAKE", "master_server_address": "10.0.0.1:50051", "protocol": "rdma",
    "device_name": "mlx5_0", "mode": "embedded", "global_segment_size": "4GB", "local_buffer_size": "1GB",
    "enable_offload": False, "tenant_id": " team-a ",
}
ASCEND_FILE = {
    "local_hostname": "10.0.0.2", "metadata_server": "P2PHANDSHAKE", "protocol": "ascend", "device_name": "",
    "use_ascend_direct": True, "alloc_in_same_node": True, "prefer_alloc_in_same_node": True,
    "preferred_segment": False, "master_server_address": "10.0.0.1:50088", "global_segment_size": "1GB",
    "local_buffer_size": 0, "enable_ssd_offload": False, "ssd_offload_path": "", "tenant_id": None,
}


def settings_file(tmp_path: Any, values: dict[str, Any]) -> dict[str, str]:
    """The environment naming a settings file that holds ``values``."""
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(values))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


def test_vllm_store_connector_file_loads(tmp_path: Any) -> None:
    settings = MooncakeSettings.load({}, settings_file(tmp_path, VLLM_FILE))
    assert settings == MooncakeSettings(
        master_server_address="10.0.0.1:50051", protocol="rdma", device_name="mlx5_0",
        global_segment_size=4 << 30, local_buffer_size=1 << 30, tenant_id="team-a",
    )


def test_vllm_ascend_store_file_loads(tmp_path: Any) -> None:
    settings = MooncakeSettings.load({}, settings_file(tmp_path, ASCEND_FILE))
    assert settings == MooncakeSettings(
        master_server_address="10.0.0.1:50088", local_hostname="10.0.0.2", protocol="ascend",
        global_segment_size=1 << 30, local_buffer_size=0, tenant_id="default",
    )


def test_ignored_file_keys_are_logged_once_in_one_line(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    environ = settings_file(tmp_path, ASCEND_FILE)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        MooncakeSettings.load({}, environ)
        MooncakeSettings.load({}, environ)  # the scheduler's client and a worker's, in one process
    [line] = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert "\n" not in line
    for key in ("use_ascend_direct", "alloc_in_same_node", "prefer_alloc_in_same_node", "preferred_segment",
                "enable_ssd_offload", "ssd_offload_path"):
        assert key in line
    assert "mooncake_client --enable_offload" in line  # and why


@pytest.mark.parametrize("mode", ["standalone", "EMBEDDED", 1])
def test_bad_mode_fails_naming_the_key_and_the_accepted_values(tmp_path: Any, mode: Any) -> None:
    environ = settings_file(tmp_path, {"master_server_address": "h:1", "mode": mode})
    with pytest.raises(ConfigError, match=r"^mode: expected one of embedded, standalone-store, got"):
        MooncakeSettings.load({}, environ)


@pytest.mark.parametrize("size", [0, "0GB", "absent"])
def test_standalone_store_contributes_no_memory(tmp_path: Any, size: Any) -> None:
    values = {"master_server_address": "h:1", "mode": "standalone-store", "global_segment_size": size}
    if size == "absent":
        del values["global_segment_size"]
    assert MooncakeSettings.load({}, settings_file(tmp_path, values)).global_segment_size == 0


@pytest.mark.parametrize(
    ("mode", "size", "match"),
    [("standalone-store", "4GB", r'mode "standalone-store" .* contributes no memory, but global_segment_size is'),
     ("embedded", 0, r'mode "embedded" .* but it is 0 or missing')],
)
def test_mode_contradicting_the_segment_size_fails_as_in_vllm(tmp_path: Any, mode: str, size: Any, match: str) -> None:
    environ = settings_file(tmp_path, {"master_server_address": "h:1", "mode": mode, "global_segment_size": size})
    with pytest.raises(ConfigError, match=r"^mode, global_segment_size: " + match):
        MooncakeSettings.load({}, environ)


@pytest.mark.parametrize(("value", "expected"), [("a", "a"), (" a ", "a"), ("", "default"), (None, "default")])
def test_tenant_id_is_normalised_as_in_vllm(tmp_path: Any, value: Any, expected: str) -> None:
    environ = settings_file(tmp_path, {"master_server_address": "h:1", "tenant_id": value})
    assert MooncakeSettings.load({}, environ).tenant_id == expected


@pytest.mark.parametrize("value", [3, ["a"], "a\nb"])
def test_bad_tenant_id_fails_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^tenant_id: expected a string"):
        MooncakeSettings.load({"master_server_address": "h:1", "tenant_id": value}, environ={})


def test_inline_settings_accept_tenant_id() -> None:
    cfg = parse_extra_config({"backend": "mooncake", "master_server_address": "h:1", "tenant_id": "a"}, environ={})
    assert cfg.backend_settings.tenant_id == "a"


@pytest.mark.parametrize("key", ["alloc_in_same_node", "mode", "enable_offload"])
def test_inline_foreign_keys_still_fail(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^unknown key\(s\) {key} in kv_connector_extra_config"):
        parse_extra_config({"backend": "mooncake", "master_server_address": "h:1", key: True}, environ={})
    with pytest.raises(ConfigError, match=rf"^unknown key\(s\) {key} in the inline Mooncake settings"):
        MooncakeSettings.load({"master_server_address": "h:1", key: True}, environ={})


def test_code_mapping() -> None:
    assert [put_status(c) for c in (0, -200, -705, -600, -800, -900)] == [
        Status.OK, Status.NO_SPACE, Status.EXISTS, Status.ERROR, Status.ERROR, Status.ERROR]
    assert [get_status(c, 8192) for c in (8192, 4096, -704, -703, -712, -707, -900, -1)] == [
        Status.OK, Status.CORRUPT, Status.MISSING, Status.MISSING, Status.MISSING, Status.CORRUPT,
        Status.ERROR, Status.ERROR]


def test_missing_mooncake_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(RuntimeError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        import_store()


def test_register_overlapping_region_replaces_it(recorded: tuple[MooncakeBackend, RecordingStore]) -> None:
    # Mooncake refuses overlaps (-600); freed-and-reused memory must still register.
    backend, store = recorded
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    base = big.data_ptr()
    store.calls.clear()
    backend.register_memory(base, 1 << 19)
    backend.register_memory(base + 4096, 4096)  # inside: nothing to do
    backend.register_memory(base + (1 << 18), 1 << 19)  # overlaps: replaces
    assert store.made("register_buffer") == [("register_buffer", (base, 1 << 19)),
                                              ("register_buffer", (base + (1 << 18), 1 << 19))]
    assert store.made("unregister_buffer") == [("unregister_buffer", (base,))]
    assert backend.wants_registration()


def test_a_lease_asks_the_master_about_every_part_of_every_block(
    recorded: tuple[MooncakeBackend, RecordingStore],
) -> None:
    # The master leases each key it is asked about (--default_kv_lease_ttl); the
    # lookup asked about one part per block only.
    backend, store = recorded
    parts = BlockParts("0123456789abcdef", ("h0", "h1"), (0, 1, 2))
    hashes = [uuid.uuid4().bytes for _ in range(3)]
    store.calls.clear()
    backend.lease_blocks(parts, hashes, seconds=30)
    asked = [key for _, (keys,) in store.made("batch_is_exist") for key in keys]
    assert asked == backend._scoped([key for h in hashes for key in parts.keys(h)])


class FlakyStore:
    """A store whose master RPC fails ``failures`` times before answering."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def setup(self, *args: object) -> int:
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        if self.calls <= self.failures:
            return [-900] * len(keys)
        return [1] * len(keys)

    def close(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("failures", "budget", "expected", "calls"),
    [(1, 0.3, [True, True], 2), (1000, 0.3, [False, False], None), (1000, 0.0, [False, False], 1)],
)
def test_rpc_failures_retried_within_budget(
    mooncake_pool: MooncakePool, failures: int, budget: float, expected: list[bool], calls: int | None
) -> None:
    # The master's port answers (the session pool), the RPC fails: retried
    # until it succeeds or the budget is spent (none: no retry).
    store = FlakyStore(failures)
    settings = MooncakeSettings.load(mooncake_pool.config, environ={})
    backend = MooncakeBackend(settings, rpc_retry_budget=budget, store_factory=lambda: store)
    assert within(30, lambda: backend.batch_exists(["a", "b"])) == expected
    assert store.calls == calls if calls is not None else store.calls > 2
    backend.close()


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_prerequisite_fails_under_ci(monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type) -> None:
    from harness import mooncake_fixtures

    monkeypatch.setattr(mooncake_fixtures, "missing_prerequisite", lambda: "mooncake_master not found")
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="mooncake_master not found"):
        mooncake_fixtures.require_mooncake()
