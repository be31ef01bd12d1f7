"""Plan a turn: continue on the holder decode, pull its KV into prefill, or recompute.

Three plans serve a turn of a conversation whose KV a decode engine holds under a lease:

``decode-local``
    Send the turn to the holder decode alone. Its prefix cache still covers the blocks it
    retains (vLLM hashes blocks on exact token ids, so an edited history simply misses the
    cache: never a wrong answer), so it computes only the new suffix and no KV moves at all.
    The price: that local prefill runs inside the decode's batch and delays every stream it is
    decoding, so it is bounded by suffix length and by the decode's load.
``pull-reuse``
    Plain P/D, except that prefill first reads the held prefix from the holder over NIXL and
    computes only the suffix; decode then reads the whole prompt from prefill as usual.
``recompute``
    Plain P/D: nothing is reused.

Planning is two pure functions on injected state, no I/O: :func:`plan_turn` says whether the
conversation has reusable KV at all (else the reason it does not); :func:`choose_reuse` picks
between the holder and P/D from the token counts (exact, or for a request that extends the
held one an upper bound: :mod:`.extension`), the holder's load and the costs
:class:`CostModel` learns online from the engines' own timings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvturn.gateway.state.table import Conversation

PlanName = Literal["recompute", "pull-reuse", "decode-local"]


@dataclass(frozen=True, slots=True)
class TurnPlan:
    plan: PlanName
    #: Why, for headers and metrics. ``recompute``: ``no-conversation``, ``first-turn``,
    #: ``nothing-held``, ``state-unavailable``,
    #: ``lease-expired``, ``holder-unhealthy``, ``below-threshold``, ``lease-reclaimed``,
    #: ``kv-gone``, ``pull-failed``, ``no-common-prefix``, ``decode-failed``,
    #: ``cache-salt-changed``, ``prefill-cached`` (a planned pull read nothing: prefill's own
    #: prefix cache already held what the lease did).
    #: ``pull-reuse``: ``reuse`` (counts unknown), ``local-off``, ``holder-draining``,
    #: ``history-edited``,
    #: ``suffix-too-long``, ``holder-busy``, ``streams-budget``, ``cheaper``. ``decode-local``:
    #: ``cheaper``;
    #: ``fork`` and ``parallel`` (the prompt starts with KV another turn holds or took, read
    #: through the holder's prefix cache: :class:`~.turns.model.Source`).
    reason: str

    @property
    def pulls(self) -> bool:
        """Whether prefill reads the conversation's KV from its holder."""
        return self.plan == "pull-reuse"

    @property
    def local(self) -> bool:
        return self.plan == "decode-local"


RECOMPUTE_NO_CONVERSATION = TurnPlan("recompute", "no-conversation")
#: Reuse is possible; which kind is for :func:`choose_reuse` to say.
REUSE = TurnPlan("pull-reuse", "reuse")


def plan_turn(
    conversation: Conversation | None,
    now: float,
    *,
    holder_healthy: bool,
    expiry_margin_s: float,
    threshold_tokens: int,
    salt: bytes | None = None,
) -> TurnPlan:
    """Whether ``conversation`` has KV a turn can reuse: :data:`REUSE`, or a ``recompute``
    plan with the reason it cannot. ``salt``: the turn's :func:`~.digests.salt_digest`."""
    if conversation is None:
        return RECOMPUTE_NO_CONVERSATION
    if conversation.holder_url is None:
        # Nothing on record: the conversation's first turn, or a later one whose predecessors
        # left no KV here (a parallel turn took it, a reply never completed, the table lost it).
        reason = "first-turn" if conversation.turns <= 1 else "nothing-held"
        return TurnPlan("recompute", reason)
    if conversation.held_salt != salt:
        # vLLM shares no KV between requests under different cache salts: neither do we.
        return TurnPlan("recompute", "cache-salt-changed")
    if not conversation.has_live_kv(now, expiry_margin_s):
        return TurnPlan("recompute", "lease-expired")
    if not holder_healthy:
        return TurnPlan("recompute", "holder-unhealthy")
    if conversation.held_tokens < threshold_tokens:
        return TurnPlan("recompute", "below-threshold")
    return REUSE


@dataclass(frozen=True, slots=True)
class LocalLimits:
    """Bounds on a local prefill, whatever the costs say: past them the turn goes to P/D."""

    enabled: bool = True
    #: Longest suffix the holder decode may prefill itself.
    max_suffix_tokens: int = 2048
    #: Requests the holder may already be serving (its decode batch) for a local prefill.
    max_running: int = 8
    #: The longest a local prefill may stall the streams the holder is decoding, seconds: the
    #: suffix's compute (:meth:`CostModel.local_stall_seconds`) runs inside one of their
    #: steps, so each of them waits that long for its next token. Past it, while the holder
    #: decodes any stream, the suffix is computed on prefill instead (a pull: decode then only
    #: reads KV). Off (infinite) by default: measured on AIPerf's agentic-coding workload at
    #: equal memory against the same gateway without it (benchmarks/results/aiperf_agentic.md
    #: and aiperf_agentic_roomy.md), 5 ms gave a later median first token in both (1.10
    #: against 0.93 s tight, 0.57 against 0.47 s roomy) and inter-token latency inside the
    #: noise (p99 98 against 110 ms tight, 65 against 46 ms roomy).
    stall_budget_s: float = math.inf
    #: Seconds of delay to other streams, per second of the turn's own time to first token:
    #: a local prefill of ``t`` seconds on a decode serving ``k`` streams costs ``t`` for this
    #: turn and ``stall_weight * k * t`` for the others.
    stall_weight: float = 1.0
    #: How much slower a local prefill may be predicted than a pull and still be chosen
    #: (0.25: up to 25%). A pull moves the whole history twice over the transfer fabric,
    #: a cost no single turn's timing shows (the bandwidth it takes from every other transfer);
    #: and where the two are as close as on one host, learned costs that differ by noise would
    #: otherwise flip the plan turn by turn.
    preference: float = 0.25


@dataclass(frozen=True, slots=True)
class ReuseInputs:
    """What :func:`choose_reuse` knows about one turn (exact, or ``None`` if unknown; the
    prompt's tokens may be an upper bound, see :mod:`.extension`)."""

    #: Tokens the holder retains for the conversation.
    held_tokens: int
    #: The new prompt's tokens, from the engine's own tokenizer and chat template.
    prompt_tokens: int | None
    #: Whether the new prompt starts with exactly the previous turn's prompt, whose KV the
    #: holder retains (``covered_tokens`` of it, in whole digest chunks).
    prefix_matches: bool | None
    covered_tokens: int
    #: Requests the holder is serving now.
    holder_running: int
    holder_url: str
    #: The prefill engine P/D would use.
    prefill_url: str


def choose_reuse(inputs: ReuseInputs, limits: LocalLimits, costs: CostModel) -> TurnPlan:
    """``decode-local`` or ``pull-reuse`` for a turn whose conversation has reusable KV."""
    if not limits.enabled:
        return TurnPlan("pull-reuse", "local-off")
    if inputs.prompt_tokens is None or inputs.prefix_matches is None:
        return REUSE
    if not inputs.prefix_matches:
        # The history changed inside what the holder retains: prefill's exact-prefix check
        # pulls what still matches, and a local prefill could be far longer than it looks.
        return TurnPlan("pull-reuse", "history-edited")
    # What the holder must compute: everything past the verified prefix (the previous reply,
    # re-rendered, may hit its cache too; not counted on).
    suffix = max(1, inputs.prompt_tokens - inputs.covered_tokens)
    if suffix > limits.max_suffix_tokens:
        return TurnPlan("pull-reuse", "suffix-too-long")
    if inputs.holder_running >= limits.max_running:
        return TurnPlan("pull-reuse", "holder-busy")
    if _stalls_streams(inputs.holder_running, inputs.holder_url, suffix, inputs.prefill_url,
                       limits, costs):  # fmt: skip
        return TurnPlan("pull-reuse", "streams-budget")
    local = costs.local_seconds(inputs.holder_url, suffix, inputs.prefill_url)
    local += limits.stall_weight * inputs.holder_running * local
    pull = costs.pull_seconds(inputs.prefill_url, inputs.held_tokens, suffix)
    if local <= pull * (1 + limits.preference):
        return TurnPlan("decode-local", "cheaper")
    return TurnPlan("pull-reuse", "cheaper")


@dataclass(frozen=True, slots=True)
class SharedInputs:
    """What :func:`choose_shared` knows about a turn whose prompt starts with KV that another
    turn owns on a decode (a fork's parent, a parallel sibling)."""

    #: ``fork`` or ``parallel`` (:class:`~.turns.model.Source`).
    kind: str
    #: The prompt's tokens (exact), and those of its start that the owner's KV covers
    #: (verified by digest, in whole blocks).
    prompt_tokens: int
    covered_tokens: int
    holder_running: int
    holder_url: str
    prefill_url: str


def choose_shared(
    inputs: SharedInputs, limits: LocalLimits, costs: CostModel, threshold_tokens: int
) -> TurnPlan | None:
    """``decode-local`` on the decode holding the shared KV (its prefix cache serves it; the
    owner's lease keeps it there), or ``None``: plain P/D is the better plan (where prefill's
    own prefix cache may serve the shared start as well). A pull is never planned: NIXL frees
    a lease's blocks after one read, and the KV is not this turn's to use up."""
    if not limits.enabled or inputs.covered_tokens < threshold_tokens:
        return None
    suffix = max(1, inputs.prompt_tokens - inputs.covered_tokens)
    if suffix > limits.max_suffix_tokens or inputs.holder_running >= limits.max_running:
        return None
    if _stalls_streams(inputs.holder_running, inputs.holder_url, suffix, inputs.prefill_url,
                       limits, costs):  # fmt: skip
        return None
    local = costs.local_seconds(inputs.holder_url, suffix, inputs.prefill_url)
    local += limits.stall_weight * inputs.holder_running * local
    recompute = costs.recompute_seconds(inputs.prefill_url, inputs.prompt_tokens)
    if local > recompute * (1 + limits.preference):
        return None
    return TurnPlan("decode-local", inputs.kind)


def _stalls_streams(
    running: int,
    holder_url: str,
    suffix: int,
    prefill_url: str,
    limits: LocalLimits,
    costs: CostModel,
) -> bool:
    """Whether a local prefill of ``suffix`` would stall the holder's ``running`` streams past
    the budget (an idle holder stalls nobody; with no budget, the default, nothing is costed)."""
    if running <= 0 or math.isinf(limits.stall_budget_s):
        return False
    return costs.local_stall_seconds(holder_url, suffix, prefill_url) > limits.stall_budget_s


class LinearCost:
    """``seconds ≈ fixed + per_token * tokens``, fitted online by least squares with
    exponential forgetting (``decay`` per observation: the last ~20 turns count).

    Before any observation it is the prior, and it is blended with the prior until the
    observations outweigh it. While the observed sizes are too alike to tell a slope from a
    fixed cost, only the fixed part is learned.
    """

    def __init__(
        self, fixed_s: float, per_token_s: float, *, decay: float = 0.95, prior_weight: float = 3.0
    ):
        self.prior = (fixed_s, per_token_s)
        self.decay = decay
        #: Observations the prior is worth: the fit is blended with it by ``n / (n + this)``,
        #: so one noisy first turn cannot swing a decision.
        self.prior_weight = prior_weight
        self.observations = 0
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(tokens) and tokens >= 0):
            return
        d = self.decay
        self._n = self._n * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.observations += 1

    def coefficients(self, prior: tuple[float, float] | None = None) -> tuple[float, float]:
        """(fixed seconds, seconds per token), both non-negative; ``prior`` replaces the one
        given at construction (e.g. a per-token cost another fit knows better)."""
        prior = prior or self.prior
        if self.observations == 0:
            return prior
        fixed, per_token = self._fit(prior)
        weight = self._n / (self._n + self.prior_weight * self.decay**self.observations)
        return (
            weight * fixed + (1 - weight) * prior[0],
            weight * per_token + (1 - weight) * prior[1],
        )

    def _fit(self, prior: tuple[float, float]) -> tuple[float, float]:
        n, x, y = self._n, self._x, self._y
        spread = n * self._xx - x * x
        # Sizes that vary by 30% or more (coefficient of variation) over five turns or more: a
        # slope can be told from a fixed cost.
        if self.observations >= 5 and spread >= 0.09 * x * x:
            slope = max((n * self._xy - x * y) / spread, 0.0)
            fixed = (y - slope * x) / n
            if fixed >= 0:
                return fixed, slope
            # No fixed cost to speak of: the line through the origin.
            return 0.0, max(self._xy / self._xx, 0.0)
        # Too alike to tell: keep the prior's per-token cost (a property of the hardware and
        # the model) and learn the fixed part, which dominates small requests.
        fixed = (y - prior[1] * x) / n
        if fixed >= 0:
            return fixed, prior[1]
        return 0.0, y / x

    def predict(self, tokens: float, prior: tuple[float, float] | None = None) -> float:
        fixed, per_token = self.coefficients(prior)
        return fixed + per_token * tokens


#: Priors, from this project's CPU engines (tiny model; DESIGN.md): a 2k-token prefill ≈ 0.25 s,
#: an engine hop ≈ 15-25 ms, NIXL moves a token's KV in about a microsecond.
PRIOR_PREFILL = (0.015, 1.5e-4)
PRIOR_LOCAL = (0.010, 1.5e-4)
PRIOR_TRANSFER = (0.020, 1e-6)


@dataclass
class CostModel:
    """What each plan costs, learned per engine from the turns the gateway serves.

    * prefill: computed tokens → prefill round trip, per prefill engine (recompute turns);
    * transfer: tokens moved → the extra seconds a pull adds to prefill, and the time from
      prefill's answer to decode's first token (decode reads the whole prompt), shared;
    * local: suffix tokens → time to first token of a ``decode-local`` turn, per decode.
    """

    prefill: dict[str, LinearCost] = field(default_factory=dict)
    local: dict[str, LinearCost] = field(default_factory=dict)
    pull: LinearCost = field(default_factory=lambda: LinearCost(*PRIOR_TRANSFER))
    handoff: LinearCost = field(default_factory=lambda: LinearCost(*PRIOR_TRANSFER))

    def _prefill(self, url: str) -> LinearCost:
        return _get(self.prefill, url, lambda: LinearCost(*PRIOR_PREFILL))

    def _local(self, url: str) -> LinearCost:
        return _get(self.local, url, lambda: LinearCost(*PRIOR_LOCAL))

    # ---- estimates ----

    def local_seconds(self, decode_url: str, suffix: int, prefill_url: str | None = None) -> float:
        """A local prefill of ``suffix`` on ``decode_url``. Until the holder's own turns tell
        its per-token cost, it is taken to compute as fast as ``prefill_url`` does (the same
        model; in P/D usually the same hardware)."""
        prior = None
        if prefill_url is not None and prefill_url in self.prefill:
            prior = (PRIOR_LOCAL[0], self.prefill[prefill_url].coefficients()[1])
        return self._local(decode_url).predict(suffix, prior)

    def local_stall_seconds(
        self, decode_url: str, suffix: int, prefill_url: str | None = None
    ) -> float:
        """The compute of a local prefill of ``suffix`` on ``decode_url``: the per-token part of
        :meth:`local_seconds`, without its fixed cost (the hop, the engine's own scheduling),
        which delays no other stream."""
        prior = None
        if prefill_url is not None and prefill_url in self.prefill:
            prior = (PRIOR_LOCAL[0], self.prefill[prefill_url].coefficients()[1])
        return self._local(decode_url).coefficients(prior)[1] * suffix

    def recompute_seconds(self, prefill_url: str, prompt: int) -> float:
        """Plain P/D of a ``prompt``-token turn: prefill, then decode's read of it."""
        return self._prefill(prefill_url).predict(prompt) + self.handoff.predict(prompt)

    def pull_seconds(self, prefill_url: str, held: int, suffix: int) -> float:
        return (
            self._prefill(prefill_url).predict(suffix)
            + self.pull.predict(held)
            + self.handoff.predict(held + suffix)
        )

    # ---- learning ----

    def observe_prefill(self, prefill_url: str, computed: int, reused: int, seconds: float) -> None:
        """A prefill round trip: ``computed`` tokens computed, ``reused`` pulled from decode."""
        fit = self._prefill(prefill_url)
        if reused == 0:
            fit.observe(computed, seconds)
        else:
            self.pull.observe(reused, max(0.0, seconds - fit.predict(computed)))

    def observe_handoff(self, prompt: int, seconds: float) -> None:
        """From prefill's answer to decode's first token (decode read ``prompt`` tokens)."""
        self.handoff.observe(prompt, seconds)

    def observe_local(self, decode_url: str, suffix: int, seconds: float) -> None:
        self._local(decode_url).observe(suffix, seconds)

    def snapshot(self) -> dict[str, object]:
        """The current fits, for the status route and for humans."""

        def fit(cost: LinearCost) -> dict[str, float]:
            fixed, per_token = cost.coefficients()
            return {
                "fixed_ms": round(fixed * 1000, 3),
                "per_1k_tokens_ms": round(per_token * 1e6, 3),
                "observations": cost.observations,
            }

        return {
            "prefill": {url: fit(c) for url, c in self.prefill.items()},
            "local": {url: fit(c) for url, c in self.local.items()},
            "pull": fit(self.pull),
            "handoff": fit(self.handoff),
        }


def _get(table: dict[str, LinearCost], key: str, make: Callable[[], LinearCost]) -> LinearCost:
    cost = table.get(key)
    if cost is None:
        cost = table[key] = make()
    return cost
