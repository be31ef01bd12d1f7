import json
from pathlib import Path

import pytest

from kvturn.gateway.cli import build_parser, engine_specs
from kvturn.gateway.config import GatewayConfig, endpoints


def test_environment_then_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTURN_LEASE_S", "12.5")
    monkeypatch.setenv("KVTURN_PREFILL_URLS", "http://p1/,http://p2")
    monkeypatch.setenv("KVTURN_DECODE_URLS", "http://d1")
    monkeypatch.setenv("KVTURN_DECODE_CONTROL_URLS", "http://c1")
    config = GatewayConfig.from_env(reuse_threshold_tokens=7, expiry_margin_s=None)
    assert config.lease_s == 12.5
    assert config.reuse_threshold_tokens == 7
    assert config.expiry_margin_s == GatewayConfig.expiry_margin_s  # None keeps the default
    assert [e.url for e in config.prefill] == ["http://p1", "http://p2"]
    assert config.decode[0].control_url == "http://c1"


def test_control_urls_pair_with_engines_in_order() -> None:
    assert endpoints(["http://a", "http://b"], ["http://ca"])[1].control_url is None
    with pytest.raises(ValueError):
        endpoints(["http://a"], ["http://x", "http://y"])


def test_a_margin_that_would_forbid_all_reuse_is_refused() -> None:
    with pytest.raises(ValueError, match="expiry_margin_s"):
        GatewayConfig(lease_s=0.4, expiry_margin_s=0.5)
    with pytest.raises(ValueError, match="lease_s"):
        GatewayConfig(lease_s=0)
    assert GatewayConfig(lease_s=0.4, expiry_margin_s=0.05).lease_s == 0.4


def test_serve_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--prefill", "http://p", "--decode", "http://d", "--lease-s", "3",
         "--max-body-bytes", "1000"]
    )  # fmt: skip
    assert args.lease_s == 3.0 and args.max_body_bytes == 1000


def test_up_flags_reach_the_engines(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    args = build_parser().parse_args(
        ["up", "--prefill", "1", "--decode", "2", "--recompute-threshold", "100",
         "--kv-cache-gb", "1", "--kv-ttl", "30"]
    )  # fmt: skip
    specs = engine_specs(args, tmp_path, "m")
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    assert len({s.port for s in specs}) == len({s.side_channel_port for s in specs}) == 3
    for spec in specs:
        assert spec.environment({})["VLLM_CPU_KVCACHE_SPACE"] == "1"
        command = spec.command()
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        extra = config["kv_connector_extra_config"]
        assert extra["kv_recompute_threshold"] == 100
        assert extra["decoder_kv_blocks_ttl"] == 30
    assert [bool(s.control_port) for s in specs] == [False, True, True]


def test_decode_kv_blocks_caps_only_the_decodes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 20480}))
    args = build_parser().parse_args(["up", "--decode-kv-blocks", "40"])
    prefill, decode = engine_specs(args, tmp_path, "m")
    assert "--num-gpu-blocks-override" not in prefill.command()
    command = decode.command()
    assert command[command.index("--num-gpu-blocks-override") + 1] == "40"
    # A request must fit in the blocks: 39 blocks of 128 tokens (vLLM keeps one as its null block).
    assert command[command.index("--max-model-len") + 1] == "4992"


def test_serve_refuses_an_open_gateway_on_a_public_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvturn.gateway import cli

    monkeypatch.delenv("KVTURN_API_KEYS", raising=False)
    monkeypatch.delenv("KVTURN_API_KEYS_FILE", raising=False)
    served: list[tuple[GatewayConfig, str]] = []
    monkeypatch.setattr(
        "kvturn.gateway.server.serve", lambda config, host, port: served.append((config, host))
    )
    base = ["serve", "--prefill", "http://p", "--decode", "http://d"]
    with pytest.raises(SystemExit, match="without API keys"):
        cli.main([*base, "--host", "0.0.0.0"])
    assert not served
    cli.main([*base, "--host", "0.0.0.0", "--allow-open"])
    cli.main([*base, "--host", "::1"])
    monkeypatch.setenv("KVTURN_API_KEYS", "sk-0123456789abcdef=team")
    cli.main([*base, "--host", "0.0.0.0"])
    assert [host for _, host in served] == ["0.0.0.0", "::1", "0.0.0.0"]
    assert served[-1][0].api_keys.tenants == {"team"}
