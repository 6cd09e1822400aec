"""The server's metrics under vLLM's names too (`vllm:num_requests_waiting`, ...), beside pagoda's
own: what llm-d's endpoint picker, the Gateway API Inference Extension, KServe's autoscaling and
Grafana dashboards built for vLLM read, so a pagoda replica drops in where a vLLM one ran. Each
family is copied as it is rendered (the same values, labels and `model_name`), under the vLLM
name of the same signal; vLLM's older names for two of them are copied too."""

from __future__ import annotations

# pagoda's family → vLLM's names for it (the first current, then older ones still read)
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagoda:num_requests_running": ("vllm:num_requests_running",),
    "pagoda:num_requests_waiting": ("vllm:num_requests_waiting",),
    "pagoda:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagoda:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagoda:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagoda:num_preemptions": ("vllm:num_preemptions",),
    "pagoda:prompt_tokens": ("vllm:prompt_tokens",),
    "pagoda:generation_tokens": ("vllm:generation_tokens",),
    "pagoda:request_success": ("vllm:request_success",),
    "pagoda:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "pagoda:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "pagoda:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pagoda:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
}
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def _family(line: str) -> str | None:
    """The metric family a line of the text format belongs to (a # HELP / # TYPE line's, or a sample's)."""
    if line.startswith(("# HELP ", "# TYPE ")):
        name = line.split(" ", 3)[2]
    elif line.startswith("pagoda:"):
        name = line.split("{", 1)[0].split(" ", 1)[0]
    else:
        return None
    if name in VLLM_NAMES:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in VLLM_NAMES:
            return name[: -len(suffix)]
    return None


def with_vllm_names(text: bytes) -> bytes:
    """Prometheus text with each mapped family repeated, after the rest, under its vLLM names."""
    copies: dict[str, list[str]] = {}
    for line in text.decode().splitlines():
        family = _family(line)
        if family is not None:
            copies.setdefault(family, []).append(line)
    extra = [line.replace(family, alias, 1) for family, lines in copies.items() for alias in VLLM_NAMES[family]
             for line in lines]
    return text + ("\n".join(extra) + "\n").encode() if extra else text
