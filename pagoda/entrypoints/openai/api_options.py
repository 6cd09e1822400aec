"""`pagoda serve`'s options for what the APIs keep and how they read a model's output: sessions,
stored responses, the state directory, batch jobs, the reasoning and tool-call parsers.
argparse only: `pagoda --help` loads nothing heavy for them."""

from __future__ import annotations

import argparse

from pagoda.engine_args import EngineArgs
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS
from pagoda.entrypoints.openai.tool_formats import TOOL_CALL_FORMATS


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready-when", choices=("loaded", "serving"), default="loaded",
                   help="when /health answers 200 while the model loads layer by layer (--progressive-load): "
                        "loaded (the default: once every layer is in place, so 200 still means ready to serve at "
                        "normal latency; 503 code model_loading before) or serving (as soon as requests are taken, "
                        "their first tokens slower while layers load); either way the X-Pagoda-Loading header "
                        "and /v1/debug/engine say how far it is")
    p.add_argument("--session-ttl", type=float, default=1800.0,
                   help="seconds a /v1/sessions conversation may stay idle before it ends and its pinned "
                        "KV prefix is let go")
    p.add_argument("--max-sessions", type=int, default=1000,
                   help="sessions held at once; past that, POST /v1/sessions answers 429")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split a thinking model's <think>...</think> from its answer: reasoning_content in chat, "
                        "reasoning items in Responses, thinking blocks in Messages, Ollama's thinking; tool calls "
                        "are parsed from the answer only")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_FORMATS), default="hermes",
                   help="how the model writes tool calls (tool_choice auto): hermes <tool_call> blocks (Qwen, "
                        "SmolLM2), llama3_json (Llama 3.1/3.2), pythonic (Llama 3.2/4), mistral [TOOL_CALLS]")
    p.add_argument("--state-dir", default=None,
                   help="where sessions, stored responses and Batch API files and jobs are kept, so that a restart "
                        "resumes them (default: $PAGODA_HOME/state/MODEL-PORT; 'none': in memory only)")
    p.add_argument("--batch-concurrency", type=int, default=None,
                   help="batch lines run at once, at a priority below every interactive request; more lines "
                        "give the batch more throughput and interactive requests a slower first token "
                        "(default: 32, or --max-num-seqs if lower)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): name=path, or JSON "
                        "'{\"name\": ..., \"path\": ...}'; a request's model picks one")
    p.add_argument("--max-stored-responses", type=int, default=10000,
                   help="Responses API responses kept for GET /v1/responses/{id} and previous_response_id, the "
                        "most recently used; their pinned KV prefixes are let go after --session-ttl idle")


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    """`pagoda run-batch`'s options: its files, and the engine's (EngineArgs)."""
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object per line ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="the answers, in the input's order ('-': stdout)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the name the lines' `model` may give")
    EngineArgs.add_cli_args(p)
