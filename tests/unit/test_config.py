import json
from pathlib import Path

import pytest

from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.ops.cli import build_parser
from kvturn.gateway.ops.up import engine_specs, up_lease_s


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


def test_up_transfer_push_starts_push_engines_with_reachable_prefills(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    args = build_parser().parse_args(
        ["up", "--transfer", "push", "--push-registration-timeout", "12", "--kv-ttl", "30"]
    )
    specs = engine_specs(args, tmp_path, "m")
    for spec in specs:
        command = spec.command()
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "KvturnPushConnector"
        assert config["kv_connector_module_path"] == "kvturn.connector.push"
        extra = config["kv_connector_extra_config"]
        # Upstream's push connector refuses bidirectional transfer.
        assert extra["bidirectional_kv_xfer"] is False
        assert extra["push_registration_timeout"] == 12
        # Every engine has a control server: a prefill's tells the gateway its NIXL identity.
        assert extra["kvturn_control_port"] == spec.control_port > 0
    pull = engine_specs(build_parser().parse_args(["up"]), tmp_path, "m")
    assert [bool(s.control_port) for s in pull] == [False, True]


def test_push_needs_each_prefills_control_url() -> None:
    decode = endpoints(["http://d"], ["http://dc"])
    with pytest.raises(ValueError, match="push transfer needs each prefill"):
        GatewayConfig(prefill=endpoints(["http://p"]), decode=decode, transfer="push")
    with pytest.raises(ValueError, match="pull or push"):
        GatewayConfig(transfer="write")
    prefill = endpoints(["http://p"], ["http://pc"])
    assert GatewayConfig(prefill=prefill, decode=decode, transfer="push").transfer == "push"
    args = build_parser().parse_args(
        ["serve", "--prefill", "http://p", "--prefill-control", "http://pc", "--decode",
         "http://d", "--transfer", "push"]
    )  # fmt: skip
    assert args.transfer == "push" and args.prefill_control == ["http://pc"]


def test_up_never_promises_a_lease_longer_than_the_decodes_grant(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvturn up --kv-ttl 20``: the gateway's lease is 20 s, not its default 60 (clients plan
    heartbeats from it); a --lease-s above --kv-ttl is cut, with a word; one below is kept."""
    monkeypatch.delenv("KVTURN_LEASE_S", raising=False)
    parse = build_parser().parse_args
    assert up_lease_s(parse(["up", "--kv-ttl", "20"])) == 20
    assert up_lease_s(parse(["up"])) is None  # 480 s of TTL: the gateway's own default
    assert up_lease_s(parse(["up", "--kv-ttl", "20", "--lease-s", "90"])) == 20
    assert "exceeds --kv-ttl" in capsys.readouterr().err
    assert up_lease_s(parse(["up", "--kv-ttl", "20", "--lease-s", "8"])) == 8
    monkeypatch.setenv("KVTURN_LEASE_S", "300")
    assert up_lease_s(parse(["up", "--kv-ttl", "120"])) == 120


def test_up_starts_prefill_with_vllms_prefix_cache(tmp_path: Path) -> None:
    """``kvturn up`` starts every engine as vLLM does by default, prefix cache on; the switch
    turns it off on prefill only (decode-local turns need decode's)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    prefill, decode = engine_specs(build_parser().parse_args(["up"]), tmp_path, "m")
    assert prefill.prefix_caching and decode.prefix_caching
    assert "--no-enable-prefix-caching" not in prefill.command()
    args = build_parser().parse_args(["up", "--no-prefill-prefix-cache"])
    prefill, decode = engine_specs(args, tmp_path, "m")
    assert "--no-enable-prefix-caching" in prefill.command()
    assert "--no-enable-prefix-caching" not in decode.command()


def test_up_can_free_the_kv_of_requests_no_gateway_sent(tmp_path: Path) -> None:
    """By default a decode keeps another proxy's requests' KV for the TTL (upstream's
    bidirectional semantics); ``--no-retain-untracked`` tells its connector to keep none."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))

    def extra(argv: list[str]) -> dict[str, object]:
        decode = engine_specs(build_parser().parse_args(["up", *argv]), tmp_path, "m")[1]
        command = decode.command()
        return json.loads(command[command.index("--kv-transfer-config") + 1])[
            "kv_connector_extra_config"
        ]

    assert "kvturn_retain_untracked" not in extra([])
    assert extra(["--no-retain-untracked"])["kvturn_retain_untracked"] is False


def test_prefill_kv_blocks_caps_only_the_prefills(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 20480}))
    args = build_parser().parse_args(["up", "--prefill-kv-blocks", "30"])
    prefill, decode = engine_specs(args, tmp_path, "m")
    assert "--num-gpu-blocks-override" not in decode.command()
    command = prefill.command()
    assert command[command.index("--num-gpu-blocks-override") + 1] == "30"
    assert command[command.index("--max-model-len") + 1] == str(29 * 128)


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
    from kvturn.gateway.ops import cli

    monkeypatch.delenv("KVTURN_API_KEYS", raising=False)
    monkeypatch.delenv("KVTURN_API_KEYS_FILE", raising=False)
    served: list[tuple[GatewayConfig, str]] = []
    monkeypatch.setattr(
        "kvturn.gateway.server.serve",
        lambda config, host, port, workers: served.append((config, host)),
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


DEPLOYMENT = """
host = "0.0.0.0"
port = 9100

[gateway]
lease_s = 30
state = "redis://10.0.0.9:6379/0"
decode_local = false

[auth]
api_keys_file = "{keys}"

[[prefill]]
url = "http://10.0.0.1:8000/"

[[decode]]
url = "http://10.0.0.2:8000"
control_url = "http://10.0.0.2:8300"

[[decode]]
url = "http://10.0.0.3:8000"
control_url = "http://10.0.0.3:8300"
"""


def _serve_settings(argv: list[str]) -> tuple[GatewayConfig, str, int, bool]:
    from kvturn.gateway.ops.serve import serve_settings

    return serve_settings(build_parser().parse_args(["serve", *argv]))


def test_a_deployment_file_describes_pools_addresses_auth_and_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVTURN_API_KEYS", "KVTURN_API_KEYS_FILE", "KVTURN_LEASE_S", "KVTURN_STATE"):
        monkeypatch.delenv(name, raising=False)
    keys = tmp_path / "keys"
    keys.write_text("sk-0123456789abcdef team-a\n")
    path = tmp_path / "kvturn.toml"
    path.write_text(DEPLOYMENT.format(keys=keys))
    config, host, port, allow_open = _serve_settings(["--config", str(path)])
    assert (host, port, allow_open) == ("0.0.0.0", 9100, False)
    assert [e.url for e in config.prefill] == ["http://10.0.0.1:8000"]
    assert [(e.url, e.control_url) for e in config.decode] == [
        ("http://10.0.0.2:8000", "http://10.0.0.2:8300"),
        ("http://10.0.0.3:8000", "http://10.0.0.3:8300"),
    ]
    assert (config.lease_s, config.state, config.decode_local) == (
        30, "redis://10.0.0.9:6379/0", False
    )  # fmt: skip
    assert config.api_keys.tenants == {"team-a"}
    # Variables override the file, flags override both.
    monkeypatch.setenv("KVTURN_LEASE_S", "45")
    monkeypatch.setenv("KVTURN_DECODE_URLS", "http://10.0.0.7:8000")
    config, _, port, _ = _serve_settings(["--config", str(path), "--port", "9200"])
    assert config.lease_s == 45 and port == 9200
    assert [e.url for e in config.decode] == ["http://10.0.0.7:8000"]
    config, *_ = _serve_settings(["--config", str(path), "--lease-s", "5", "--decode", "http://d9"])
    assert config.lease_s == 5 and [e.url for e in config.decode] == ["http://d9"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gateway]\nlease = 3\n", "unknown gateway setting(s) lease"),
        ("[gateway]\nlease_s = 'soon'\n", "lease_s must be a float"),
        ("[gateway]\ndecode_local = 1\n", "decode_local must be a bool"),
        ("[gateway]\ncontrol_secret = 'x'\n", "unknown gateway setting(s) control_secret"),
        ("[[decode]]\nurl = 'd:8000'\n", "is not an http:// URL"),
        # The engine client speaks plain HTTP: refused at start, not at the first request.
        ("[[decode]]\nurl = 'https://d:8000'\n", "https:// is not supported"),
        ("[[decode]]\nurl = 'http://d'\ncontrol_url = 'https://d:8300'\n", "https://"),
        ("[[decode]]\nurl = 'http://d'\ncontroll_url = 'http://c'\n", "controll_url"),
        ("prt = 1\n", "prt"),
        ("host = \n", "not valid TOML"),
        ("[[prefill]]\nurl = 'http://p'\n", "at least one prefill and one decode"),
    ],
)
def test_deployment_file_mistakes_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    for name in ("KVTURN_PREFILL_URLS", "KVTURN_DECODE_URLS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "kvturn.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as caught:
        _serve_settings(["--config", str(path)])
    assert message in str(caught.value)


def test_https_engine_urls_are_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine client speaks plain HTTP: an https:// engine or control URL, from flags or
    variables, stops ``kvturn serve`` at start with the reason, not each request later."""
    for name in ("KVTURN_PREFILL_URLS", "KVTURN_DECODE_URLS", "KVTURN_DECODE_CONTROL_URLS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="https:// is not supported"):
        _serve_settings(["--prefill", "https://p:8000", "--decode", "http://d:8000"])
    with pytest.raises(SystemExit, match="https:// is not supported"):
        _serve_settings(
            ["--prefill", "http://p", "--decode", "http://d", "--decode-control", "https://c"]
        )
    monkeypatch.setenv("KVTURN_DECODE_URLS", "HTTPS://d:8000")
    with pytest.raises(SystemExit, match="https:// is not supported"):
        _serve_settings(["--prefill", "http://p"])
    with pytest.raises(ValueError, match="https://"):
        GatewayConfig(prefill=endpoints(["https://p"]))
    # A keys file that cannot be read stops it too, naming the file.
    monkeypatch.setenv("KVTURN_DECODE_URLS", "http://d:8000")
    monkeypatch.setenv("KVTURN_OPERATOR_KEYS_FILE", "/nonexistent/operator-keys")
    with pytest.raises(SystemExit, match="/nonexistent/operator-keys"):
        _serve_settings(["--prefill", "http://p"])


def test_decodes_listed_once_find_their_control_servers_by_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVTURN_DECODE_URLS", "KVTURN_DECODE_CONTROL_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "kvturn.toml"
    path.write_text(
        "[gateway]\ndecode_control_port = 8300\n"
        "[[prefill]]\nurl = 'http://10.0.0.1:8000'\n"
        "[[decode]]\nurl = 'http://10.0.0.2:8000'\n"
        "[[decode]]\nurl = 'http://[fd00::3]:8000'\n"
        "[[decode]]\nurl = 'http://10.0.0.4:8000'\ncontrol_url = 'http://10.0.0.9:9000'\n"
    )
    config, *_ = _serve_settings(["--config", str(path)])
    assert [e.control_url for e in config.decode] == [
        "http://10.0.0.2:8300",
        "http://[fd00::3]:8300",
        "http://10.0.0.9:9000",  # one given is kept
    ]
    # Without the setting, a decode listed without one has none (a stock engine).
    config, *_ = _serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2"])
    assert config.decode[0].control_url is None
    config, *_ = _serve_settings(
        ["--prefill", "http://p:1", "--decode", "http://d:2", "--decode-control-port", "7"]
    )
    assert config.decode[0].control_url == "http://d:7"


def test_kvturn_engine_runs_an_engine_on_its_hosts_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvturn.gateway.ops.cli import main
    from kvturn.gateway.ops.engine import engine_spec

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    args = build_parser().parse_args(
        ["engine", "--role", "decode", "--model", str(tmp_path), "--host", "0.0.0.0",
         "--advertise-host", "10.0.0.2", "--control-port", "8301", "--kv-ttl", "90",
         "--", "--max-num-seqs", "4"]
    )  # fmt: skip
    spec = engine_spec(args)
    command, env = spec.command(), spec.environment({})
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.2"  # where peers reach it
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # no --cpu: no pinning
    assert (spec.url, spec.control_url) == ("http://10.0.0.2:8000", "http://10.0.0.2:8301")
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert (config["kv_role"], config["kv_buffer_device"]) == ("kv_consumer", "cpu")
    assert (extra["kvturn_control_port"], extra["kvturn_control_host"]) == (8301, "0.0.0.0")
    assert extra["decoder_kv_blocks_ttl"] == 90
    assert command[-2:] == ["--max-num-seqs", "4"]
    # A model of the user's own brings its own template and tool parser; dtype as vLLM picks.
    assert "--chat-template" not in command and "--tool-call-parser" not in command
    assert command[command.index("--dtype") + 1] == "auto"
    assert "--no-enable-prefix-caching" not in command  # decode's prefix cache: local turns
    assert command[command.index("--max-model-len") + 1] == "4096"  # the model's own, local

    # A model id the engine's host resolves: no local config, so vLLM's own length.
    argv = ["engine", "--role", "decode", "--model", "org/some-model", "--host", "10.0.0.2"]
    remote = engine_spec(build_parser().parse_args(argv))
    assert "--max-model-len" not in remote.command()
    assert remote.command()[remote.command().index("--model") + 1] == "org/some-model"
    assert remote.served_model_name == "org/some-model"

    # GPU: no CPU-only settings.
    argv = ["engine", "--role", "prefill", "--device", "cuda", "--host", "10.0.0.1", "--model"]
    gpu = engine_spec(build_parser().parse_args([*argv, str(tmp_path)]))
    command, env = gpu.command(), gpu.environment({})
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cuda" and config["kv_role"] == "kv_producer"
    assert "kvturn_nixl_progress_delay_us" not in config["kv_connector_extra_config"]
    assert "kvturn_control_port" not in config["kv_connector_extra_config"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    # A prefill keeps vLLM's prefix cache unless told not to.
    assert "--no-enable-prefix-caching" not in command
    off = engine_spec(build_parser().parse_args([*argv, str(tmp_path), "--no-prefix-cache"]))
    assert "--no-enable-prefix-caching" in off.command()

    # Push mode: a prefill has a control server too (its NIXL identity, for the gateway).
    argv = ["engine", "--role", "prefill", "--model", str(tmp_path), "--host", "10.0.0.1",
            "--transfer", "push", "--push-registration-timeout", "15"]  # fmt: skip
    push = engine_spec(build_parser().parse_args(argv))
    config = json.loads(push.command()[push.command().index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvturnPushConnector"
    assert config["kv_connector_extra_config"]["push_registration_timeout"] == 15
    assert push.control_url == "http://10.0.0.1:8300"

    # Listening everywhere without saying where peers reach it is refused, by name.
    with pytest.raises(SystemExit, match="advertise_host"):
        main(["engine", "--role", "decode", "--model", str(tmp_path), "--host", "0.0.0.0"])
    # --print shows what would run.
    assert main(["engine", "--role", "prefill", "--model", str(tmp_path), "--print"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1" in printed[0]
    assert printed[1].split()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_up_device_cuda_gives_gpu_engines_without_cpu_settings(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    cpu = engine_specs(build_parser().parse_args(["up"]), tmp_path, "m")
    gpu = engine_specs(build_parser().parse_args(["up", "--device", "cuda"]), tmp_path, "m")
    assert [s.device for s in cpu] == ["cpu", "cpu"] and [s.device for s in gpu] == ["cuda"] * 2
    for cpu_spec, gpu_spec in zip(cpu, gpu, strict=True):
        command, env = gpu_spec.command(), gpu_spec.environment({})
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config["kv_buffer_device"] == "cuda"
        assert "kvturn_nixl_progress_delay_us" not in config["kv_connector_extra_config"]
        cpu_only = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                    "VLLM_USE_AOT_COMPILE"}  # fmt: skip
        assert not cpu_only & env.keys(), cpu_only & env.keys()
        assert cpu_only <= cpu_spec.environment({}).keys()
        assert gpu_spec.cpu is None  # no core pinning
        # The same ports, roles and flags otherwise.
        assert (gpu_spec.role, gpu_spec.port) == (cpu_spec.role, cpu_spec.port)
        # kvturn's own (local) models need nothing from the hub, on either device.
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"


def test_kvturn_engine_keeps_the_hub_reachable_for_a_model_id(tmp_path: Path) -> None:
    from kvturn.gateway.ops.engine import engine_spec

    hub = engine_spec(
        build_parser().parse_args(["engine", "--role", "decode", "--model", "org/name"])
    )
    env = hub.environment({"HF_TOKEN": "t"})
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env
    assert env["HF_TOKEN"] == "t"
    # The operator's own choice still applies.
    assert hub.environment({"HF_HUB_OFFLINE": "1"})["HF_HUB_OFFLINE"] == "1"
    (tmp_path / "config.json").write_text("{}")
    local = engine_spec(
        build_parser().parse_args(["engine", "--role", "decode", "--model", str(tmp_path)])
    )
    assert local.environment({})["HF_HUB_OFFLINE"] == "1"
    # --device cuda leaves the GPU package's defaults alone.
    gpu = engine_spec(
        build_parser().parse_args(
            ["engine", "--role", "prefill", "--device", "cuda", "--model", "org/name"]
        )
    )
    assert "VLLM_USE_AOT_COMPILE" not in gpu.environment({})


def test_an_engine_without_the_control_secret_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decode's control channel releases and holds every lease: without the shared secret
    ``kvturn engine`` refuses to run it, unless told --insecure-control (then it warns, and the
    connector's config says so); the connector itself refuses the same way."""
    from kvturn.connector.control_server import control_secret
    from kvturn.gateway.ops.cli import main
    from kvturn.gateway.ops.engine import engine_spec
    from kvturn.wire import CONTROL_SECRET_ENV, INSECURE_CONTROL_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    monkeypatch.delenv(CONTROL_SECRET_ENV, raising=False)
    decode = ["engine", "--role", "decode", "--model", str(tmp_path)]
    with pytest.raises(SystemExit, match="--insecure-control"):
        main(decode)
    insecure = engine_spec(build_parser().parse_args([*decode, "--insecure-control"]))
    config = json.loads(insecure.command()[insecure.command().index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"][INSECURE_CONTROL_CONFIG] is True
    secure = engine_spec(build_parser().parse_args(decode))
    config = json.loads(secure.command()[secure.command().index("--kv-transfer-config") + 1])
    assert INSECURE_CONTROL_CONFIG not in config["kv_connector_extra_config"]

    with pytest.raises(RuntimeError, match=CONTROL_SECRET_ENV):
        control_secret(None, {})
    with pytest.raises(RuntimeError, match=CONTROL_SECRET_ENV):
        control_secret("", {INSECURE_CONTROL_CONFIG: False})
    assert control_secret(None, {INSECURE_CONTROL_CONFIG: True}) is None
    assert control_secret("s3cret", {}) == "s3cret"
