"""What the workers already know of each request, so that each step's `SchedulerOutput` carries
only the deltas: a request's first step sends it whole (`NewRequestData`), later steps its new
tokens and blocks (`CachedRequestData`), a request resumed after preemption its whole block table
again (the workers kept its state, not its blocks), and finished ids once."""

from __future__ import annotations

from pagoda.core.lora_residency import LoRAResidency
from pagoda.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.request import Request


class WorkerDeltas:
    def __init__(self, loras: LoRAResidency | None = None) -> None:
        self.loras = loras  # the LoRA adapters the workers hold (None: LoRA is off)
        self._sent_tokens: dict[str, int] = {}  # request → tokens the workers have
        self._sent_blocks: dict[str, int] = {}  # request → blocks the workers have
        self._resumed: set[str] = set()  # preempted since: their blocks were freed
        self._finished: set[str] = set()  # for the next message: the workers drop them

    def preempted(self, request_id: str) -> None:
        if request_id in self._sent_tokens:
            self._resumed.add(request_id)

    def finished(self, request_id: str) -> None:
        if self._sent_tokens.pop(request_id, None) is not None:
            self._finished.add(request_id)
            if self.loras is not None:
                self.loras.finished(request_id)
        self._sent_blocks.pop(request_id, None)
        self._resumed.discard(request_id)

    def message(self, scheduled: list[tuple[Request, int]], preempted: list[str],
                spec_tokens: dict[str, list[int]]) -> SchedulerOutput:
        """The step (``scheduled``: each request and its token count) as deltas."""
        out = SchedulerOutput(preempted_req_ids=preempted, finished_req_ids=self._finished,
                              scheduled_spec_tokens=spec_tokens)
        self._finished = set()
        sent_tokens, sent_blocks_of, resumed_ids = self._sent_tokens, self._sent_blocks, self._resumed
        for request, num_new in scheduled:
            rid = request.request_id
            out.num_scheduled_tokens[rid] = num_new
            if rid not in sent_tokens:
                out.new_requests.append(NewRequestData(
                    rid, list(request.prompt_token_ids), request.sampling_params, list(request.block_ids),
                    request.num_computed_tokens, list(request.output_token_ids),
                    [list(ids) for ids in request.group_block_ids], request.pooling_params, request.lora_id,
                    request.images, _slot(request),
                ))
                if self.loras is not None:
                    self.loras.sent(request, out)
            else:
                resumed = rid in resumed_ids
                sent_blocks = 0 if resumed else sent_blocks_of[rid]
                groups = [ids[sent_blocks:] for ids in request.group_block_ids] if request.group_block_ids else []
                out.cached_requests.append(CachedRequestData(
                    rid, request.all_token_ids[sent_tokens[rid]:], request.block_ids[sent_blocks:],
                    request.num_computed_tokens, resumed, groups, _slot(request) if resumed else -1,
                ))
            if resumed_ids:
                resumed_ids.discard(rid)
            sent_tokens[rid] = len(request.all_token_ids)
            sent_blocks_of[rid] = len(request.block_ids)
        if self.loras is not None:
            out.lora_unloads = self.loras.take_unloads()
        return out


def _slot(request: Request) -> int:
    return -1 if request.state_slot is None else request.state_slot
