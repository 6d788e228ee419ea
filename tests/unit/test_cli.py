"""The ``vllm-aio`` command line (``vllm_aio.cli``): what each command parses, refuses and warns about."""

from __future__ import annotations

import logging

import pytest

from vllm_aio.cli import main, parser, router


def test_router_parses_its_instances_and_options():
    args = parser().parse_args(["router", "--instance", "http://a:8000", "--instance", "http://b:8000",
                                "--port", "9000", "--interval", "0.1", "--stall", "2"])
    assert args.run is router.run
    assert (args.policy, args.instance, args.host, args.port, args.interval, args.stall) == (
        "priority", ["http://a:8000", "http://b:8000"], "127.0.0.1", 9000, 0.1, 2.0)


def test_router_refuses_an_unknown_policy(capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["router", "--policy", "round-robin", "--instance", "http://a", "--instance", "http://b"])
    assert exit_.value.code == 2 and "invalid choice: 'round-robin'" in capsys.readouterr().err


def test_router_needs_two_instances(capsys):
    assert main(["router", "--instance", "http://a"]) == 2
    assert "at least two --instance" in capsys.readouterr().err


def test_migrate_with_a_policy_fails_in_one_line_naming_the_router(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", "--policy", "priority", "--instance", "http://a", "--instance", "http://b"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "vllm-aio router --policy priority" in err


def test_migrate_needs_source_target_and_prompt(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", "--source", "http://a", "--target", "http://b"])
    assert exit_.value.code == 2 and "--prompt" in capsys.readouterr().err


class _NoPool:
    """A Mooncake pool that fails to start: the command's parsing and warnings, without mooncake."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def start(self) -> None:
        from vllm_aio.devtools.mooncake_pool import PoolError

        raise PoolError("not started in a unit test")


@pytest.mark.parametrize("name, warnings", [("serve-mooncake", 0), ("mooncake-pool", 1)])
def test_mooncake_pool_is_the_old_name_of_serve_mooncake_and_warns_once(name, warnings, monkeypatch, caplog,
                                                                       capsys):
    monkeypatch.setattr("vllm_aio.devtools.mooncake_pool.MooncakePool", _NoPool)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert main([name, "--size", "16MB"]) == 1
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == warnings and all("serve-mooncake" in line for line in said)
    assert "vllm-aio serve-mooncake: not started in a unit test" in capsys.readouterr().err
