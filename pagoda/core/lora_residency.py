"""Which LoRA adapters the workers hold, and which a step's batch may run at once.

The scheduler decides both, so the workers never guess: a request's first step carries its
adapter in ``SchedulerOutput.lora_loads`` when the workers do not hold it, and adapters no request
uses any more are dropped in ``lora_unloads``. An adapter stays loaded while any request the
workers know uses it (running, or preempted and waiting to resume: it resumes on the version it
started with); of the idle ones, the ``max_cpu_loras`` used last are kept for the next request.
An adapter a newer version has replaced under its name is dropped as soon as it is idle.

``max_loras`` bounds the distinct adapters in one batch (vLLM's rule): a waiting request under a
further adapter waits until one of the running adapters has no request left in the batch.
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.lora.request import LoRARequest
from pagoda.request import Request


class LoRAResidency:
    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._held: OrderedDict[int, LoRARequest] = OrderedDict()  # held by the workers, least recent first
        self._users: dict[str, int] = {}  # request the workers know → its adapter id
        self._latest: dict[str, int] = {}  # adapter name → the id of its newest version
        self._unloads: list[int] = []  # for the next message

    def fits(self, request: Request, running: list[Request]) -> bool:
        """Whether ``request`` may join a batch of ``running`` under the max_loras bound."""
        lora_id = request.lora_id
        if not lora_id:
            return True
        ids = {r.lora_id for r in running if r.lora_id}
        return lora_id in ids or len(ids) < self.max_loras

    def sent(self, request: Request, out: SchedulerOutput) -> None:
        """``request`` goes to the workers in ``out`` for the first time."""
        lora = request.lora_request
        if lora is None:
            return
        self._users[request.request_id] = lora.lora_int_id
        newest = self._latest.get(lora.lora_name)
        if newest is None or lora.lora_int_id > newest:
            self._latest[lora.lora_name] = lora.lora_int_id
        if lora.lora_int_id in self._held:
            self._held.move_to_end(lora.lora_int_id)
        else:
            self._held[lora.lora_int_id] = lora
            out.lora_loads.append(lora)
        self._evict_idle()

    def finished(self, request_id: str) -> None:
        """The workers drop ``request_id``; its adapter may become idle."""
        if self._users.pop(request_id, None) is not None:
            self._evict_idle()

    def take_unloads(self) -> list[int]:
        unloads, self._unloads = self._unloads, []
        return unloads

    @property
    def held_ids(self) -> list[int]:
        return list(self._held)

    def _evict_idle(self) -> None:
        in_use = set(self._users.values())
        idle = [i for i in self._held if i not in in_use]
        replaced = [i for i in idle if self._latest.get(self._held[i].lora_name, i) != i]
        over = max(0, len(idle) - len(replaced) - self.max_cpu_loras)
        keep_order = [i for i in idle if i not in replaced]
        for lora_id in replaced + keep_order[:over]:
            del self._held[lora_id]
            self._unloads.append(lora_id)
