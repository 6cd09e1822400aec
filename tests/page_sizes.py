"""Which pages back a piece of this process's memory, and how much it maps (/proc/self, Linux)."""

from __future__ import annotations

from pathlib import Path

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether Linux gives transparent huge pages to a mapping that asks ("always" or "madvise")."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def anon_huge_kib(address: int) -> int:
    """The kB of 2 MiB anonymous pages in the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise LookupError(f"no mapping holds {address:#x}")


def mapped_kib() -> int:
    """This process's mapped memory in kB (VmSize): what an mmap never given back keeps growing."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1])
