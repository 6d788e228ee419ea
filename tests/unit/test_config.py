"""Unit tests of ``vllm_aio.config``: sizes, validation messages, env overrides, defaults,
and the hand-over of each backend's keys to its settings class (parsed once, here)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from harness.prerequisites import ROOT
from vllm_aio.backends import SETTINGS
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache_settings import MemcacheSettings
from vllm_aio.backends.mooncake_settings import MooncakeSettings
from vllm_aio.config import BACKENDS, AioConfig, TransferMode, parse_extra_config, parse_size
from vllm_aio.errors import ConfigError

NO_ENV: dict[str, str] = {}


def parse(extra: dict, environ: dict[str, str] | None = None) -> AioConfig:
    return parse_extra_config(extra, environ=NO_ENV if environ is None else environ)


# ---- sizes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GB", 4 << 30),
        ("512MB", 512 << 20),
        ("1.5GB", 3 << 29),
        ("64KB", 64 << 10),
        ("1TB", 1 << 40),
        ("100B", 100),
        ("4096", 4096),
    ],
)
def test_size_string_with_binary_unit_parses_to_bytes(text, expected):
    assert parse_size("local_pool_size", text) == expected


@pytest.mark.parametrize("text", ["4gb", "4 GB", " 4GB ", "4G", "4g"])
def test_size_unit_is_case_insensitive_and_b_suffix_optional(text):
    assert parse_size("local_pool_size", text) == 4 << 30


def test_size_int_is_taken_as_bytes():
    assert parse_size("local_pool_size", 123456) == 123456


@pytest.mark.parametrize("value", ["lots", "4XB", "GB", "", "-1GB", "1e9", "4 G B", 1.5, None, [4]])
def test_unparseable_size_fails_naming_the_key_and_the_accepted_units(value):
    with pytest.raises(ConfigError, match=r"^local_pool_size: expected a size .*GB"):
        parse_size("local_pool_size", value)


@pytest.mark.parametrize("value", [0, -1, -(4 << 30), "0", "0GB", "0.0000000001GB"])
def test_zero_or_negative_size_fails_as_not_positive(value):
    with pytest.raises(ConfigError, match=r"^local_pool_size: must be positive"):
        parse_size("local_pool_size", value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_size_is_rejected_although_bool_is_an_int(value):
    with pytest.raises(ConfigError, match=r"^local_pool_size: expected a size"):
        parse_size("local_pool_size", value)


def test_extra_config_size_string_is_parsed():
    assert parse({"local_pool_size": "512MB"}).backend_settings.local_pool_size == 512 << 20


def test_extra_config_bad_size_fails_naming_local_pool_size():
    with pytest.raises(ConfigError, match=r"^local_pool_size:"):
        parse({"local_pool_size": "big"})


# ---- unknown keys and types -----------------------------------------------


def test_unknown_key_fails_naming_it_and_listing_accepted_keys():
    with pytest.raises(ConfigError) as info:
        parse({"backed": "local"})
    message = str(info.value)
    assert "backed" in message
    general = [f.name for f in dataclasses.fields(AioConfig) if f.name != "backend_settings"]
    for key in general + ["local_pool_size", "local_pool_name"]:
        assert key in message.split("accepted keys:")[1]


def test_several_unknown_keys_are_all_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) typo_a, typo_b"):
        parse({"typo_b": 1, "typo_a": 2, "salt": "s"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("consumer_is_to_load", "true"),
        ("consumer_is_to_put", 1),
        ("save_decode_cache", None),
        ("discard_partial_chunks", "yes"),
        ("salt", 5),
        ("backend", ["local"]),
        ("local_pool_name", 7),
        ("priority_cutoffs", 0),
        ("priority_cutoffs", [0, "1"]),
        ("priority_cutoffs", [True]),
    ],
)
def test_wrong_type_fails_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: expected"):
        parse({key: value})


@pytest.mark.parametrize("cutoffs", [[1, 0], [0, 0], list(range(8))])
def test_priority_cutoffs_out_of_order_repeated_or_too_many_fail_naming_the_key(cutoffs):
    with pytest.raises(ConfigError, match=r"^priority_cutoffs: expected up to 7 distinct integers in increasing"):
        parse({"priority_cutoffs": cutoffs})


def test_priority_cutoffs_become_a_tuple():
    assert parse({"priority_cutoffs": [-1, 0]}).priority_cutoffs == (-1, 0)


def test_local_pool_name_accepts_null():
    assert parse({"local_pool_name": None}).backend_settings.local_pool_name is None


def test_backend_outside_accepted_list_fails_naming_accepted_values():
    with pytest.raises(ConfigError) as info:
        parse({"backend": "no-such-store"})
    message = str(info.value)
    assert message.startswith("backend:")
    assert "no-such-store" in message
    for name in BACKENDS:
        assert name in message


def test_local_backend_is_accepted():
    assert parse({"backend": "local"}).backend == "local"


def test_discard_partial_chunks_false_is_rejected_with_reason():
    with pytest.raises(ConfigError, match=r"^discard_partial_chunks: only true .*whole blocks"):
        parse({"discard_partial_chunks": False})


def test_discard_partial_chunks_true_is_accepted():
    assert parse({"discard_partial_chunks": True}).discard_partial_chunks is True


# ---- local_pool_name -------------------------------------------------------


@pytest.mark.parametrize("name", ["pd", "pd-pool_1.v2", "A" * 64, "0"])
def test_local_pool_name_of_safe_characters_is_accepted(name):
    cfg = parse({"local_pool_name": name})
    assert cfg.backend_settings.local_pool_name == name


@pytest.mark.parametrize("name", ["", "A" * 65, "a/b", "../x", "has space", "naïve", "x\n"])
def test_local_pool_name_outside_the_safe_set_fails_naming_the_key(name):
    with pytest.raises(ConfigError, match=r"^local_pool_name: expected 1-64 characters"):
        parse({"local_pool_name": name})


# ---- environment overrides -------------------------------------------------


def test_env_backend_overrides_extra_config():
    cfg = parse({"backend": "local"}, environ={"VLLM_AIO_BACKEND": "local"})
    assert cfg.backend == "local"


def test_env_backend_outside_accepted_list_fails():
    with pytest.raises(ConfigError, match=r"^backend: expected one of"):
        parse({}, environ={"VLLM_AIO_BACKEND": "nonsense"})


def test_env_local_pool_size_overrides_extra_config_as_bytes():
    cfg = parse({"local_pool_size": "1GB"}, environ={"VLLM_AIO_LOCAL_POOL_SIZE": "8GB"})
    assert cfg.backend_settings.local_pool_size == 8 << 30


def test_env_local_pool_size_unparseable_fails_naming_the_variable():
    with pytest.raises(ConfigError, match=r"VLLM_AIO_LOCAL_POOL_SIZE"):
        parse({}, environ={"VLLM_AIO_LOCAL_POOL_SIZE": "banana"})


def test_environ_argument_replaces_process_environment(monkeypatch):
    monkeypatch.setenv("VLLM_AIO_BACKEND", "nonsense")
    assert parse_extra_config({}, environ={}).backend == "local"


def test_process_environment_is_read_when_environ_not_given(monkeypatch):
    monkeypatch.setenv("VLLM_AIO_BACKEND", "nonsense")
    with pytest.raises(ConfigError, match=r"^backend:"):
        parse_extra_config({})


def test_unrelated_env_variables_are_ignored():
    assert parse({}, environ={"VLLM_AIO_SALT": "x", "PATH": "/bin"}) == AioConfig()


# ---- defaults --------------------------------------------------------------


def test_empty_extra_config_gives_documented_defaults():
    cfg = parse({})
    assert cfg == AioConfig()
    assert cfg.backend == "local"
    assert cfg.backend_settings == LocalSettings(local_pool_size=4 << 30, local_pool_name=None)
    assert cfg.consumer_is_to_load is True
    assert cfg.consumer_is_to_put is False
    assert cfg.save_decode_cache is False
    assert cfg.discard_partial_chunks is True
    assert cfg.salt == ""


def test_given_values_replace_defaults():
    cfg = parse({"salt": "s1", "save_decode_cache": True, "consumer_is_to_put": True})
    assert (cfg.salt, cfg.save_decode_cache, cfg.consumer_is_to_put) == ("s1", True, True)


def test_config_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AioConfig().salt = "x"  # type: ignore[misc]


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "key,value",
    [("use_layerwise", "yes"), ("layerwise_prefetch_layers", 1.5), ("load_async", 1), ("transfer_mode", 1),
     ("transfer_timeout", "10s"), ("dynamic_buffer_layers", True), ("dynamic_buffer_count", 2.0),
     ("staging_buffer_size", "lots")],
)
def test_wrong_type_of_a_transfer_key_fails_naming_it(key, value):
    with pytest.raises(ConfigError, match=key):
        parse_extra_config({key: value}, environ={})


# ---- transfer_mode and the keys it replaced --------------------------------


@pytest.mark.parametrize("mode", ["whole_blocks", "layerwise", "async", "dynamic_buffer"])
def test_transfer_mode_accepts_each_mode(mode):
    assert parse({"transfer_mode": mode}).transfer_mode == TransferMode(mode)


def test_transfer_mode_defaults_to_whole_blocks():
    assert parse({}).transfer_mode is TransferMode.WHOLE_BLOCKS


@pytest.mark.parametrize("value", ["bulk", "Layerwise", "", True, 2])
def test_bad_transfer_mode_fails_naming_the_accepted_values(value):
    with pytest.raises(ConfigError, match=r"^transfer_mode: expected one of whole_blocks, layerwise, async, "
                                          r"dynamic_buffer, got"):
        parse({"transfer_mode": value})


def test_a_mode_given_as_a_string_to_the_dataclass_becomes_the_mode():
    assert AioConfig(transfer_mode="async").transfer_mode is TransferMode.ASYNC
    with pytest.raises(ConfigError, match=r"^transfer_mode: expected one of"):
        AioConfig(transfer_mode="bulk")


def test_dynamic_buffer_count_defaults_to_two_buffers():
    assert parse({"transfer_mode": "dynamic_buffer"}).dynamic_buffer_count == 2


@pytest.mark.parametrize("count", [1, 0, -2])
def test_dynamic_buffer_count_below_two_is_refused(count):
    with pytest.raises(ConfigError, match=rf"^dynamic_buffer_count: expected an integer >= 2, got {count}"):
        parse({"transfer_mode": "dynamic_buffer", "dynamic_buffer_count": count})


@pytest.mark.parametrize("extra", [{"dynamic_buffer_count": 2},
                                   {"transfer_mode": "layerwise", "dynamic_buffer_count": 3}])
def test_dynamic_buffer_count_with_another_mode_fails_naming_both_keys(extra):
    with pytest.raises(ConfigError, match=r"^dynamic_buffer_count, transfer_mode: .* but transfer_mode is "):
        parse(extra)


@pytest.mark.parametrize(
    ("old", "mode", "count"),
    [({"use_layerwise": True}, "layerwise", 2), ({"load_async": True}, "async", 2),
     ({"dynamic_buffer_layers": 4}, "dynamic_buffer", 4), ({"use_layerwise": False}, "whole_blocks", 2),
     ({"dynamic_buffer_layers": 0}, "whole_blocks", 2), ({"use_layerwise": False, "load_async": True}, "async", 2)],
)
def test_replaced_keys_map_to_the_transfer_mode(old, mode, count):
    cfg = parse(old)
    assert (cfg.transfer_mode, cfg.dynamic_buffer_count) == (TransferMode(mode), count)


def test_each_replaced_key_logs_one_warning_naming_the_new_key_and_value_and_new_keys_none():
    # A process of its own: the warning is logged once per process (scheduler and workers each parse).
    code = """import logging
logging.basicConfig(format="%(message)s")
from vllm_aio.config import parse_extra_config
for extra in ({"use_layerwise": True}, {"load_async": True}, {"dynamic_buffer_layers": 3}) * 2:
    parse_extra_config(extra, environ={})
parse_extra_config({"transfer_mode": "dynamic_buffer", "dynamic_buffer_count": 3}, environ={})
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"kv_connector_extra_config: {old} is deprecated and goes in the next release; write {new} instead"
        for old, new in (("use_layerwise", "transfer_mode: layerwise"), ("load_async", "transfer_mode: async"),
                         ("dynamic_buffer_layers", "transfer_mode: dynamic_buffer, dynamic_buffer_count: 3"))
    ]


@pytest.mark.parametrize(
    ("extra", "keys"),
    [({"use_layerwise": True, "load_async": True}, "load_async, use_layerwise"),
     ({"dynamic_buffer_layers": 2, "use_layerwise": True}, "dynamic_buffer_layers, use_layerwise"),
     ({"dynamic_buffer_layers": 2, "load_async": True}, "dynamic_buffer_layers, load_async")],
)
def test_replaced_keys_selecting_two_modes_fail_naming_both(extra, keys):
    with pytest.raises(ConfigError, match=rf"^{keys}: these select .* choose one transfer_mode"):
        parse(extra)


@pytest.mark.parametrize(
    ("extra", "keys"),
    [({"transfer_mode": "async", "use_layerwise": True}, "transfer_mode, use_layerwise"),
     ({"transfer_mode": "layerwise", "use_layerwise": False}, "transfer_mode, use_layerwise"),
     ({"transfer_mode": "whole_blocks", "dynamic_buffer_layers": 2}, "transfer_mode, dynamic_buffer_layers"),
     ({"transfer_mode": "async", "load_async": False, "use_layerwise": False}, "transfer_mode, load_async")],
)
def test_a_replaced_key_contradicting_transfer_mode_fails_naming_both(extra, keys):
    with pytest.raises(ConfigError, match=rf"^{keys}: transfer_mode is "):
        parse(extra)


def test_a_replaced_key_agreeing_with_transfer_mode_is_accepted():
    cfg = parse({"transfer_mode": "layerwise", "use_layerwise": True, "load_async": False})
    assert cfg.transfer_mode is TransferMode.LAYERWISE


def test_dynamic_buffer_layers_contradicting_dynamic_buffer_count_fails_naming_both():
    with pytest.raises(ConfigError, match=r"^dynamic_buffer_count, dynamic_buffer_layers: 3 and 2 buffers"):
        parse({"dynamic_buffer_layers": 2, "dynamic_buffer_count": 3})


@pytest.mark.parametrize("value", [1, -2, True, "2"])
def test_dynamic_buffer_layers_accepts_zero_or_two_and_more(value):
    with pytest.raises(ConfigError, match=r"^dynamic_buffer_layers: expected 0 \(off\) or an integer >= 2"):
        parse({"dynamic_buffer_layers": value})


@pytest.mark.parametrize("extra", [{"dynamic_buffer_resident_blocks": 8, "priority_cutoffs": [0]},
                                   {"dynamic_buffer_resident_blocks": 8, "transfer_mode": "dynamic_buffer"}])
def test_resident_blocks_need_the_buffer_and_priority_classes(extra):
    with pytest.raises(ConfigError, match=r"dynamic_buffer_resident_blocks: needs transfer_mode dynamic_buffer and "
                                          r"priority_cutoffs"):
        parse(extra)


def test_negative_resident_blocks_are_refused():
    with pytest.raises(ConfigError, match="dynamic_buffer_resident_blocks: expected an integer >= 0, got -1"):
        parse({"dynamic_buffer_resident_blocks": -1})


def test_transfer_timeout_must_be_positive_seconds():
    with pytest.raises(ConfigError, match="transfer_timeout"):
        parse_extra_config({"transfer_timeout": 0}, environ={})
    assert parse_extra_config({"transfer_timeout": 2}, environ={}).transfer_timeout == 2.0


# ---- each backend's settings, parsed once at the boundary -------------------------


def test_mooncake_settings_are_parsed_here_from_file_inline_keys_and_env(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.1:1", "protocol": "rdma", "tenant_id": "t"}))
    cfg = parse({"backend": "mooncake", "protocol": "tcp"},
                environ={"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GB"})
    assert cfg.backend_settings == MooncakeSettings(
        master_server_address="10.0.0.1:1", protocol="tcp", tenant_id="t", global_segment_size=1 << 30)


def test_memcache_inline_device_id_reaches_its_settings(tmp_path):
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.local_service.protocol = host_tcp\n")
    cfg = parse({"backend": "memcache", "device_id": 3}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert cfg.backend_settings == MemcacheSettings(
        config_path=str(conf), meta_service_url="tcp://127.0.0.1:5000", protocol="host_tcp", device_id=3)
    with pytest.raises(ConfigError, match=r"^device_id: expected an integer"):
        parse({"backend": "memcache", "device_id": "npu0"}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"master_server_address": "h:1"}, r'^master_server_address: Mooncake settings need backend "mooncake", '
                                           r"but backend is 'local'"),
        ({"backend": "memcache", "tenant_id": "a"}, r'^tenant_id: Mooncake settings need backend "mooncake"'),
        ({"backend": "mooncake", "master_server_address": "h:1", "device_id": 0},
         r'^device_id: Memcache settings need backend "memcache", but backend is \'mooncake\''),
        ({"backend": "mooncake", "master_server_address": "h:1", "local_pool_size": "1GB"},
         r'^local_pool_size: embedded pool settings need backend "local"'),
    ],
)
def test_a_key_of_another_backend_fails_naming_that_backend(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse(extra)


def test_unknown_key_lists_the_keys_of_the_chosen_backend():
    with pytest.raises(ConfigError) as info:
        parse({"backend": "mooncake", "master_server_address": "h:1", "protocl": "tcp"})
    message = str(info.value)
    assert message.startswith("unknown key(s) protocl in kv_connector_extra_config")
    assert message.endswith("with backend mooncake also: " + ", ".join(MooncakeSettings.keys))


def test_settings_of_another_backend_are_refused():
    with pytest.raises(ConfigError, match=r"^backend_settings: LocalSettings are not the settings of backend"):
        AioConfig(backend="mooncake")


def test_local_pool_size_variable_is_the_embedded_pools_alone():
    assert parse({"backend": "mooncake", "master_server_address": "h:1"},
                 environ={"VLLM_AIO_LOCAL_POOL_SIZE": "banana"}).backend == "mooncake"


def test_parsing_any_backends_settings_imports_no_store_library(tmp_path):
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n")
    blocked = ("mooncake", "memcache_hybrid", "memfabric_hybrid", "torch_npu", "torch", "numpy", "vllm",
               "vllm_aio.backends.mooncake", "vllm_aio.backends.memcache", "vllm_aio.backends.local")
    code = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked) + f"""
from vllm_aio.config import parse_extra_config
parse_extra_config({{}}, environ={{}})
parse_extra_config({{"backend": "mooncake", "master_server_address": "h:1"}}, environ={{}})
parse_extra_config({{"backend": "memcache"}}, environ={{"MMC_LOCAL_CONFIG_PATH": {str(conf)!r}}})
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# Every key of every backend, with what else its backend needs to get as far as that key.
_MMC_CONF = "ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.local_service.protocol = host_tcp\n"
_NEEDS = {
    "local": {},
    "mooncake": {"master_server_address": "127.0.0.1:1"},
    "memcache": {},
    "tiered": {"remote_backend": "mooncake", "master_server_address": "127.0.0.1:1"},
}
_EVERY_KEY = [(None, f.name) for f in dataclasses.fields(AioConfig) if f.name != "backend_settings"] + [
    (backend, key) for backend, settings in SETTINGS.items() for key in settings.keys
]


@pytest.mark.parametrize("backend, key", _EVERY_KEY, ids=[f"{b or 'general'}-{k}" for b, k in _EVERY_KEY])
@pytest.mark.parametrize("value", [{}, [{}]], ids=["object", "list"])
def test_every_key_refuses_a_value_of_the_wrong_type_naming_the_key(tmp_path, backend, key, value):
    conf = tmp_path / "mmc-local.conf"
    conf.write_text(_MMC_CONF)
    extra = {**_NEEDS.get(backend, {}), **({"backend": backend} if backend else {}), key: value}
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        parse_extra_config(extra, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})
