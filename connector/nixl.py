"""``KvturnConnector``: a thin NixlConnector subclass for conversation-aware KV reuse.

Load it into a vLLM engine with::

    --kv-transfer-config '{"kv_connector": "KvturnConnector",
                           "kv_connector_module_path": "kvturn.connector.nixl", ...}'

It overrides only what kvturn needs, on the scheduler side:

* **Decode** (``request_finished_all_groups``): when NIXL retains a finished request's blocks
  (bidirectional mode), add chained digests of the token ids those blocks hold, and publish the
  params on the kvturn control server (``kvturn_control_port`` in ``kv_connector_extra_config``)
  so the gateway learns them even for streamed responses, which carry none in vLLM 0.32.
* **Prefill** (``get_num_new_matched_tokens``): before pulling a decode's KV, compare those
  digests with the new prompt's exact token ids and trim the pull to the common prefix, or drop
  it. vLLM itself does not check that the pulled KV belongs to this prompt.

It also fixes two CPU-only problems of running P and D on one small machine: NIXL's
progress thread spinning a core (:mod:`.nixl_progress`), and the worker re-pinning the model's
main thread; and it paces the idle engine loop that polls retained blocks
(:mod:`.engine_pacing`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvturn.connector.control_server import ControlServer
from kvturn.connector.engine_pacing import cap_worker_spin_window
from kvturn.connector.nixl_progress import DEFAULT_PROGRESS_DELAY_US, raise_progress_thread_delay
from kvturn.connector.retained_store import RetainedStore
from kvturn.kv_params import (
    DIGEST_CHUNK_TOKENS,
    PREFIX_DIGESTS_KEY,
    common_prefix_tokens,
    prefix_digests,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that the engine's own log configuration shows these lines.
logger = logging.getLogger("vllm.kvturn.connector")

_CHECKED_KEY = "_kvturn_prefix_checked"


class KvturnConnector(NixlConnector):
    """NixlConnector plus retained-KV publication (decode) and prefix verification (prefill)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        extra = transfer_config.kv_connector_extra_config or {}
        raise_progress_thread_delay(
            int(extra.get("kvturn_nixl_progress_delay_us", DEFAULT_PROGRESS_DELAY_US))
        )
        # On CPU, NixlConnector's worker pins the *calling* thread, the model's main thread, to
        # the last core of each NUMA node "for KV transfer". Two engines on one machine then
        # share one core for all their compute. Keep the affinity the engine was started with.
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        super().__init__(vllm_config, role, kv_cache_config)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        self._idle_step_sleep_s = float(extra.get("kvturn_idle_step_sleep_ms", 10)) / 1000
        if role == KVConnectorRole.WORKER:
            cap_worker_spin_window(float(extra.get("kvturn_worker_spin_ms", 2)) / 1000)
        self._block_size = vllm_config.cache_config.block_size
        self._retained = RetainedStore()
        self._control: ControlServer | None = None
        port = extra.get("kvturn_control_port")
        if role == KVConnectorRole.SCHEDULER and port is not None:
            host = str(extra.get("kvturn_control_host", "127.0.0.1"))
            self._control = ControlServer(self._retained, host, int(port)).start()

    # ---- scheduler side: prefill -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and not params.get(_CHECKED_KEY):
            params[_CHECKED_KEY] = True
            self._trim_to_verified_prefix(request, params)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _trim_to_verified_prefix(self, request: Request, params: dict[str, Any]) -> None:
        """Limit a pull from decode to the tokens this prompt provably shares with it."""
        if not params.get("remote_block_ids"):
            return
        digests = params.get(PREFIX_DIGESTS_KEY)
        prompt = list(request.prompt_token_ids or [])
        held = int(params.get("remote_num_tokens") or 0)
        if digests is None:
            # No proof of what the decode holds: never pull unverified KV.
            verified = 0
        else:
            verified = common_prefix_tokens(digests, prompt, DIGEST_CHUNK_TOKENS)
        # Leave at least the last prompt token to compute, so prefill produces logits.
        usable = max(0, min(verified, held, len(prompt) - 1))
        if usable == 0:
            params["remote_block_ids"] = None
            params["remote_num_tokens"] = 0
        else:
            num_blocks = -(-usable // self._block_size)
            params["remote_block_ids"] = [
                list(group)[:num_blocks] for group in params["remote_block_ids"]
            ]
            params["remote_num_tokens"] = usable
        logger.info(
            "kvturn: request %s: prompt %d tokens, decode holds %d, verified common prefix %d, "
            "will pull up to %d",
            request.request_id,
            len(prompt),
            held,
            verified,
            usable,
        )

    # ---- scheduler side: both ---------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        # While finished requests' blocks wait to be read (or to expire), the engine core steps
        # in a busy loop to poll the connector, burning a core on an otherwise idle engine.
        # An empty step means nothing is running: pace those steps instead.
        if scheduler_output.total_num_scheduled_tokens == 0 and self._idle_step_sleep_s > 0:
            time.sleep(self._idle_step_sleep_s)
        return meta

    # ---- scheduler side: decode ------------------------------------------------------------

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        if delay_free and params and params.get("do_remote_decode"):
            held = int(params.get("remote_num_tokens") or 0)
            tokens = list(request.all_token_ids)[:held]
            params[PREFIX_DIGESTS_KEY] = prefix_digests(tokens, DIGEST_CHUNK_TOKENS)
            params["remote_block_ids"] = [list(g) for g in params["remote_block_ids"]]
            ttl = float(self.connector_scheduler.decoder_kv_blocks_ttl)  # type: ignore[union-attr]
            self._retained.publish(request.request_id, dict(params), ttl_s=ttl)
        return delay_free, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        # Retained blocks are single-use: once a prefill has read them (or they expired) they
        # are freed, so stop advertising them; the gateway then recomputes instead of sending
        # a pull that decode would decline.
        for request_id in connector_output.finished_sending or ():
            self._retained.discard(request_id)

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.stop()
            self._control = None
        super().shutdown()
