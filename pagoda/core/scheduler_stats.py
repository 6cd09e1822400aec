"""What the scheduler reports: its counters and gauges (`SchedulerStats`, read by /metrics,
/v1/debug/engine and `LLMEngine.stats`) and speculative decoding's running totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.core.kv_tiers.tier_stack import hits_of

if TYPE_CHECKING:
    from pagoda.core.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks held by requests / all blocks (unused cached blocks count as free)
    num_preemptions_total: int
    num_blocks: int = 0
    num_cached_free_blocks: int = 0  # in the prefix cache, used by nobody: reclaimable
    prefix_cache_query_tokens: int = 0  # prompt tokens of admitted requests, each request once
    prefix_cache_hit_tokens: int = 0
    prefix_cache_preempted_query_tokens: int = 0  # resumed after preemption: prompt + output tokens
    prefix_cache_preempted_hit_tokens: int = 0
    spec_num_drafts: int = 0  # speculative decoding: verifications (a request's drafts in one step)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # ... and accepted
    spec_draft_tokens_per_pos: list[int] = field(default_factory=list)  # drafts verified at position i of a run
    spec_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # ... and accepted there
    spec_draft_seconds: float = 0.0  # time spent proposing
    spec_verify_seconds: float = 0.0  # time of the steps that verified drafts
    num_sessions_pinned: int = 0  # sessions whose prefix is pinned in the prefix cache
    session_pinned_blocks: int = 0  # blocks those pins hold (shared prefixes counted per session)
    session_pins_released_under_pressure: int = 0
    # KV tiers under the prefix cache (core/kv_tiers), in tokens: promoted back from each tier,
    # and copied down into host memory
    kv_offload_memory_hit_tokens: int = 0
    kv_offload_disk_hit_tokens: int = 0
    kv_offload_saved_tokens: int = 0
    kv_offload_remote_read_tokens: int = 0  # blocks read whole from the shared store (--kv-offload-url)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification gives, the target's own included (vLLM's mean acceptance length)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    @property
    def memory_pressure(self) -> float:
        """The seed's score: (used KV memory - reclaimable cached memory) / total KV memory."""
        return self.kv_cache_usage


@dataclass
class SpecDecodeCounters:
    """Speculative decoding's running totals, per draft position too (position i: the i-th
    draft of a run, counted when a run that long is verified; accepted when the target agreed
    up to and including it)."""

    num_drafts: int = 0
    drafts_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def count(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        grow = num_drafts - len(self.drafts_per_pos)
        if grow > 0:
            self.drafts_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(num_drafts):
            self.drafts_per_pos[i] += 1
            self.accepted_per_pos[i] += i < num_accepted


def scheduler_stats(num_running: int, num_waiting: int, num_preemptions: int, kv: KVCacheManager,
                    spec: SpecDecodeCounters) -> SchedulerStats:
    """The scheduler's figures with its KV cache manager's and speculative decoding's."""
    sessions = kv.sessions
    tiers = kv.tiers.store.counters if kv.tiers is not None else None
    bs = kv.block_size
    return SchedulerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        kv_cache_usage=kv.usage(),
        num_preemptions_total=num_preemptions,
        num_blocks=kv.pool.num_blocks,
        num_cached_free_blocks=kv.num_evictable_blocks,
        prefix_cache_query_tokens=kv.prefix_query_tokens,
        prefix_cache_hit_tokens=kv.prefix_hit_tokens,
        prefix_cache_preempted_query_tokens=kv.prefix_preempted_query_tokens,
        prefix_cache_preempted_hit_tokens=kv.prefix_preempted_hit_tokens,
        spec_num_drafts=spec.num_drafts,
        spec_draft_tokens=sum(spec.drafts_per_pos),
        spec_accepted_tokens=sum(spec.accepted_per_pos),
        spec_draft_tokens_per_pos=list(spec.drafts_per_pos),
        spec_accepted_tokens_per_pos=list(spec.accepted_per_pos),
        spec_draft_seconds=spec.draft_seconds,
        spec_verify_seconds=spec.verify_seconds,
        num_sessions_pinned=len(sessions) if sessions is not None else 0,
        session_pinned_blocks=kv.num_session_pinned_blocks,
        session_pins_released_under_pressure=sessions.num_released_under_pressure if sessions else 0,
        kv_offload_memory_hit_tokens=tiers.memory_hits * bs if tiers else 0,
        kv_offload_disk_hit_tokens=tiers.disk_hits * bs if tiers else 0,
        kv_offload_saved_tokens=tiers.saved * bs if tiers else 0,
        kv_offload_remote_read_tokens=hits_of(kv.tiers.store.lower, "remote") * bs if tiers else 0,
    )
