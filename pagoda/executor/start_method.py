"""How the tensor-parallel ranks' processes start: fork or spawn (vLLM's rule, and its override).

- fork where it is safe, as vLLM does on CPU: a rank is a copy of this process, so a plain script
  with `LLM(model=..., tensor_parallel_size=2)` at its top level works (spawn re-imports the main
  script in every rank, which would build the LLM again there; multiprocessing refuses that with
  "An attempt has been made to start a new process before the current process has finished its
  bootstrapping phase").
- spawn where fork is not safe: CUDA is initialized (a forked child cannot use it), or other
  Python threads are running (a lock one of them holds would stay locked forever in the child;
  the server's engine thread, for one).
- PAGODA_WORKER_MULTIPROC_METHOD=fork|spawn decides instead (vLLM's VLLM_WORKER_MULTIPROC_METHOD).

Where spawn is used and the main script would build the LLM again in each rank, the start fails
at once, saying to put that code under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import ast
import logging
import sys
import threading
from types import FrameType, ModuleType

import torch

from pagoda import envs

logger = logging.getLogger(__name__)

ENV = "PAGODA_WORKER_MULTIPROC_METHOD"
METHODS = ("fork", "spawn")


def start_method() -> tuple[str, str]:
    """"fork" or "spawn" by the rules above, and why (for the error a spawn may lead to)."""
    chosen = envs.PAGODA_WORKER_MULTIPROC_METHOD
    if chosen:
        if chosen not in METHODS:
            raise ValueError(f"{ENV} must be one of {', '.join(METHODS)}, got {chosen!r}")
        return chosen, f"{ENV}={chosen}"
    reasons = []
    if torch.cuda.is_initialized():
        reasons.append("CUDA is initialized")
    if threading.active_count() > 1:
        reasons.append(f"{threading.active_count() - 1} other thread(s) are running")
    if reasons:
        logger.info("tensor-parallel ranks start by spawn, not fork: %s", "; ".join(reasons))
        return "spawn", "; ".join(reasons)
    return "fork", "nothing makes fork unsafe"


def check_spawn_is_safe(why: str) -> None:
    """Fail now, saying what to write, if a spawned rank would build the LLM again: it re-imports
    the main script (as `__mp_main__`), so any call at the script's top level that is not under
    `if __name__ == "__main__":` runs there too. `why`: why spawn, not fork."""
    main = sys.modules.get("__main__")
    line = _main_line_running(main)
    if line is None or main is None or _guarded(main.__file__, line):
        return
    raise RuntimeError(
        f"tensor-parallel ranks start by spawn here ({why}), and spawn runs the top level of {main.__file__} "
        f"again in every rank: line {line} would start the engine there too. Put the code that creates the LLM "
        "under `if __name__ == \"__main__\":`")


def _main_line_running(main: ModuleType | None) -> int | None:
    """The line of the main script's top level that is running now (it led to this call), or None
    (an interactive session, `python -c`, or the script's top level has finished)."""
    if main is None or not getattr(main, "__file__", None):
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame.f_lineno
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether `line` of the script at `path` lies in an `if __name__ == "__main__":` block."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let multiprocessing say what it says
    return any(isinstance(node, ast.If) and _is_main_test(node.test)
               and node.body[0].lineno <= line <= (node.body[-1].end_lineno or 0) for node in ast.walk(tree))


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1
