import pytest

from kvturn.gateway.cli import build_parser
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


def test_serve_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--prefill", "http://p", "--decode", "http://d", "--lease-s", "3",
         "--max-body-bytes", "1000"]
    )  # fmt: skip
    assert args.lease_s == 3.0 and args.max_body_bytes == 1000
