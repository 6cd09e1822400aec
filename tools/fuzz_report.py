"""What a fuzz run saw, per route: cases, statuses, failures and time (shared by the API families)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class FuzzReport:
    """What a fuzz run saw: cases and statuses per route, the failures, the time taken."""

    cases: Counter = field(default_factory=Counter)
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def record(self, route: str, status: int | str, failure: str | None = None) -> None:
        self.cases[route] += 1
        self.statuses[route][status] += 1
        if failure:
            self.failures.append(f"{route}: {failure}")

    def lines(self) -> list[str]:
        out = [f"{sum(self.cases.values())} cases in {self.seconds:.1f} s, {len(self.failures)} failures"]
        for route in sorted(self.cases):
            seen = ", ".join(f"{s}: {c}" for s, c in sorted(self.statuses[route].items(), key=lambda x: str(x[0])))
            out.append(f"  {route:32s} {self.cases[route]:5d}   {seen}")
        return out + [f"  FAIL {f}" for f in self.failures[:20]]

