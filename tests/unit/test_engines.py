"""The engine launcher's plans and pre-flight checks (no engine is started here)."""

from __future__ import annotations

import json
import socket
from itertools import pairwise
from pathlib import Path

import pytest

from kvturn.gateway.ops.launch import engines
from kvturn.gateway.ops.launch.engines import EngineError, KVSettings, plan_specs, preflight
from kvturn.gateway.ops.launch.local_models import ensure_model


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_model("tiny")


def test_plan_gives_each_engine_its_own_ports_and_core(tiny: Path) -> None:
    specs = plan_specs(tiny, num_prefill=1, num_decode=2, base_port=9100)
    ports = [p for s in specs for p in (s.port, s.side_channel_port, s.control_port) if p]
    assert len(ports) == len(set(ports))
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    assert specs[0].cpu != specs[1].cpu
    assert specs[0].control_port == 0 and all(s.control_port for s in specs[1:])
    # vLLM's prefix cache on every engine, as vLLM starts them; off on prefill only if asked.
    assert all("--no-enable-prefix-caching" not in s.command() for s in specs)
    off = plan_specs(tiny, base_port=9100, prefill_prefix_caching=False)
    assert "--no-enable-prefix-caching" in off[0].command()
    assert "--no-enable-prefix-caching" not in off[1].command()
    # Prefill schedules by priority (a pull's short suffix ahead of queued recomputes).
    policies = [dict(pairwise(s.command())).get("--scheduling-policy") for s in specs]
    assert policies == ["priority", None, None]


def test_engines_load_the_kvturn_connector(tiny: Path) -> None:
    spec = plan_specs(tiny, kv=KVSettings(decoder_kv_blocks_ttl_s=77))[1]
    argv = spec.command()
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "KvturnConnector"
    assert config["kv_connector_module_path"] == "kvturn.connector.nixl"
    assert config["kv_role"] == "kv_consumer"
    assert config["kv_load_failure_policy"] == "fail"  # "recompute" hangs on vLLM 0.32
    extra = config["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True
    assert extra["decoder_kv_blocks_ttl"] == 77
    assert extra["kvturn_control_port"] == spec.control_port
    env = spec.environment({})
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(spec.cpu)
    # A transfer to a host that stopped answering fails in seconds, not the kernel's ~15 min;
    # an operator's own setting stands.
    assert env["UCX_TCP_USER_TIMEOUT"] == "5s"
    assert spec.environment({"UCX_TCP_USER_TIMEOUT": "30s"})["UCX_TCP_USER_TIMEOUT"] == "30s"


def test_max_model_len_follows_the_model(tiny: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert plan_specs(small)[0].max_model_len == 8192
    assert plan_specs(tiny)[0].max_model_len == 20480


def test_preflight_names_a_taken_port(tiny: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        specs = plan_specs(tiny, base_port=port)
        with pytest.raises(EngineError, match=f"port {port}"):
            preflight(specs)


def test_preflight_refuses_without_memory(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "available_memory_bytes", lambda: 2_000_000_000)
    with pytest.raises(EngineError, match="not enough memory"):
        preflight(plan_specs(tiny, base_port=9300))


def test_preflight_says_when_vllm_is_missing(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(EngineError, match="vLLM is not installed"):
        preflight(plan_specs(tiny, base_port=9400))


def test_a_dead_engine_reports_its_log(tiny: Path, tmp_path: Path) -> None:
    spec = plan_specs(tiny, base_port=9500)[0]
    broken = engines.EngineSpec(**{**spec.__dict__, "extra_args": ("--no-such-flag",)})
    with pytest.raises(EngineError, match="exited with code"):
        engines.start_engines([broken], tmp_path, timeout_s=120)
