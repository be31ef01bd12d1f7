"""``KvturnPushConnector``: vLLM's NixlPushConnector plus kvturn's decode leases, so one
deployment has both push transfer for prefill → decode and reuse across turns.

Load it into every engine of a push deployment (``kvturn up --transfer push`` does)::

    --kv-transfer-config '{"kv_connector": "KvturnPushConnector",
                           "kv_connector_module_path": "kvturn.connector.push", ...}'

**What upstream refuses, and what kvturn does instead.** vLLM 0.32's push scheduler raises
``NotImplementedError`` when ``bidirectional_kv_xfer`` is set: bidirectional reuse has a
prefill READ the blocks a decode retained, and the push worker has no READ path (its writer
thread owns NIXL's notifications and only ever WRITEs). kvturn leaves bidirectional off and
never has a prefill read decode memory in push mode. Reuse across turns is decode-local
instead: the next turn goes to the decode that holds the conversation, whose prefix cache
serves the retained blocks. Where the gateway still sends a turn through prefill (a suffix too
long to compute on decode), it pushes to the holder: decode registers only the blocks its
prefix cache does not cover, and upstream trims the WRITE to those, so prefill writes the new
suffix only. Nothing here changes how a push transfer itself runs.

What this adds on decode, scheduler side only:

* **Leases on finished turns.** Upstream frees a push decode's blocks as soon as a request
  finishes (into the prefix cache, where any new request may evict them). A finished turn of a
  conversation (its prompt pushed by a prefill, or computed here) is retained under a lease
  exactly as :class:`~kvturn.connector.nixl.KvturnConnector` retains one: published on the
  control server, renewed by heartbeats, freed by a release, a newer turn, memory pressure or
  the deadline. The blocks are held through upstream's own worker path: the request is named
  to the worker (``reqs_in_batch``) with a deadline (``reqs_to_send``), and the worker frees
  them when it passes, as it frees a prefill's unread blocks. This is safe in push mode because
  no NIXL notification ever names a finished decode request: the only notifications a push
  decode gets for a request are the WRITE completions that precede its decoding.
* **Abandoned registrations are freed.** A decode registers its blocks with the prefill when
  the request is scheduled. If that prefill dies before it writes (or its request fails), the
  gateway aborts the decode request; vLLM keeps an aborted request's blocks while it waits for
  remote KV, until the transfer reports done, which never happens. Measured on these engines
  (``tests/test_push_engines.py`` with this release turned off): prefill killed while
  computing a 16k-token prompt, the decode's KV usage stayed at the aborted request's blocks
  (3.1% of its cache, from 0) 40 s later, with a 10 s ``push_registration_timeout``: upstream's
  soft watchdog only stops a registration not yet sent from being sent. Here,
  once that same timeout has passed for an aborted request whose KV never arrived, the
  connector reports its receive as finished, so vLLM frees the blocks, and drops any late
  completion for it. The timeout must outlast any write a live prefill could still make:
  the gateway aborts the prefill request whenever it gives up on one, and a prefill whose
  request was aborted or failed never writes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

# Before vLLM's own imports: refuse a vLLM release the connector was not built for.
from kvturn.connector import vllm_guard  # noqa: F401

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPushConnector
from vllm.v1.request import RequestStatus

from kvturn.connector.leases import publication_key
from kvturn.connector.nixl import KvturnConnectorBase, aborted_after_decoding
from kvturn.wire import CONVERSATION_KEY, PushStateName

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PushArrivals:
    """Whether the KV pushed for a decode request has arrived, by the gateway's request id:
    asked from the control server's thread while the engine's thread records it.

    Nothing in vLLM tells decode, or anyone, that a prefill's WRITE failed (or that the prefill
    died after answering): the request just waits. The gateway, once prefill has answered,
    asks here; a push still awaited a while later will not come, and the gateway serves the
    turn another way."""

    def __init__(self, capacity: int = 10_000):
        self._changed = threading.Condition()
        self._states: OrderedDict[str, PushStateName] = OrderedDict()
        self._capacity = capacity

    def set(self, request_id: str, state: PushStateName) -> None:
        key = publication_key(request_id)
        with self._changed:
            self._states[key] = state
            self._states.move_to_end(key)
            while len(self._states) > self._capacity:
                self._states.popitem(last=False)
            self._changed.notify_all()

    def wait(self, key: str, timeout_s: float) -> PushStateName:
        """The request's state once its push arrived, or as it is after ``timeout_s``."""
        with self._changed:
            self._changed.wait_for(lambda: self._states.get(key) == "arrived", timeout_s)
            return self._states.get(key, "unknown")


class KvturnPushConnector(KvturnConnectorBase, NixlPushConnector):
    """NixlPushConnector plus leases on decode's finished turns (see the module docstring)."""

    TRANSFER_MODE = "push"

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self._registration_timeout_s = float(
            transfer_config.get_from_extra_config("push_registration_timeout", self._ttl_s)
        )
        # Decode requests whose pushed KV has not arrived yet: request id -> give-up time.
        self._awaiting: dict[str, float] = {}
        # Of those, the ones already aborted (their blocks wait for the push to end).
        self._abandoned: dict[str, float] = {}
        # Abandoned past their time: reported done at the next engine output; then any late
        # completion for them is dropped (vLLM no longer knows the request).
        self._give_up: set[str] = set()
        self._given_up: set[str] = set()
        # Finished turns retained this step: named to the worker with their deadline.
        self._retained_now: set[str] = set()
        self.arrivals = PushArrivals()
        if self._control is not None:
            self._control.pushes = self.arrivals

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            if num_external_tokens > 0:
                deadline = time.perf_counter() + self._registration_timeout_s
                self._awaiting[request.request_id] = deadline
                self.arrivals.set(request.request_id, "awaiting")
            else:  # its prefix cache holds the whole prompt: nothing to receive
                self.arrivals.set(request.request_id, "arrived")
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        now = time.perf_counter()
        for request_id, give_up_at in list(self._abandoned.items()):
            if give_up_at <= now:
                del self._abandoned[request_id]
                self._give_up.add(request_id)
        if self._retained_now:
            # Named before super() so that the deadlines the base class adds reach the worker
            # in the same step (the worker honours a deadline only for a request it tracks).
            self._local.update(self._retained_now)
            self._retained_now.clear()
        return super().build_connector_meta(scheduler_output)

    def _expecting(self) -> bool:
        # A request awaiting its pushed KV: only an engine step notices that it has arrived.
        # Paced like an idle engine (kvturn.connector.engine_pacing), a push decode would
        # notice it up to 250 ms late after 2 s of waiting; stepping flat out instead spins a
        # core while prefill computes. Steps stay short (10 ms apart) while any is awaited.
        return bool(self._awaiting)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        received = set(connector_output.finished_recving or ())
        late = received & self._given_up
        if late:
            # vLLM asserts that a finished receive names a live request.
            received -= late
            self._given_up -= late
        if self._give_up:
            received |= self._give_up
            self._given_up |= self._give_up
            self._give_up.clear()
        if received or connector_output.finished_recving is not None:
            connector_output.finished_recving = received
        for request_id in received:
            if self._awaiting.pop(request_id, None) is not None:
                self.arrivals.set(request_id, "arrived")
        super().update_connector_output(connector_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        give_up_at = self._awaiting.pop(request_id, None)
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        self._usage.drop(request_id)
        if give_up_at is not None:
            # Aborted before its KV arrived: vLLM keeps the blocks until the push ends.
            self._abandoned[request_id] = give_up_at
            return delay_free, params
        sent = request.kv_transfer_params or {}
        if (
            delay_free
            or sent.get("do_remote_decode")
            or not sent.get(CONVERSATION_KEY)
            or self._control is None
            or not (request.status in _FINISHED or aborted_after_decoding(request))
            or request.num_computed_tokens <= 0
            or not any(block_ids)
        ):
            return delay_free, params
        retained: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": block_ids,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_mode": self.TRANSFER_MODE,
        }
        self._retain(request, retained)
        self._retained_now.add(request_id)
        return True, retained
