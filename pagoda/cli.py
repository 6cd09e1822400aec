"""The `pagoda` command: generate | chat | serve | router | bench | tune, and the model store's list | pull |
push | cp | show | rm | create (pagoda/store/commands.py).

Building the parser imports nothing heavy (no torch, transformers or fastapi, not even numpy):
each command imports what it needs when it runs, so `pagoda --help` answers at once.
"""

from __future__ import annotations

import argparse
import copy
import logging
import secrets
import sys
import uuid
from collections.abc import Callable

from pagoda import __version__, config_file
from pagoda.engine_args import EngineArgs  # not from pagoda.config, which imports torch (~1.5 s)
from pagoda.entrypoints import served_models  # argparse only; the pool loads when several models are served
from pagoda.entrypoints.openai import api_options  # argparse only: the APIs' serve options
from pagoda.quantize import command as quantize_command  # argparse only; torch loads when it runs
from pagoda.ray_serve import options as ray_serve_options  # argparse only; ray loads when --ray-serve runs
from pagoda.router import options as router_options  # argparse only; the router loads when it runs
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.security import encrypt_command  # argparse only; cryptography loads when it runs
from pagoda.security import keys_command, options as access_options  # argparse only (keys, roles, audit)
from pagoda.security import moderation, tls  # their serve options; pyahocorasick loads when a list is read
from pagoda.store import commands as store_commands  # argparse only; each verb imports what it needs
from pagoda.threads import configure_server_openmp  # os.environ only

LOG_LEVELS = ["debug", "info", "warning", "error"]
DEFAULT_LOG_LEVEL = "warning"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and shows each option's default after its help (also for
    options given no help), unless the help already states it or the option is a plain flag
    (store_true, --help, --version)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._default_note(action):
            action = copy.copy(action)  # argparse prints nothing for help=None
            action.help = self._default_note(action).strip()
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        return help_text if "default" in help_text else help_text + self._default_note(action)

    @staticmethod
    def _default_note(action: argparse.Action) -> str:
        if action.default is argparse.SUPPRESS or action.help is argparse.SUPPRESS:
            return ""
        if isinstance(action, argparse.BooleanOptionalAction):
            return f" (default: {'on' if action.default else 'off'})"
        takes_value = action.nargs != 0
        if not (takes_value and (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return ""
        return " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that shows defaults (subparsers inherit the class) and may fill itself
    on first use: `populate` runs once, before the parser parses or prints help, so a command
    whose options come from heavy modules (bench) costs nothing unless it is used."""

    def __init__(self, *args, populate: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure_populated(self) -> None:
        populate, self._populate = self._populate, None
        if populate is not None:
            populate(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ensure_populated()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ensure_populated()
        return super().format_help()

    def format_usage(self) -> str:
        self._ensure_populated()
        return super().format_usage()


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed",
                   help="sampling seed, for repeatable output (default: a fresh one per request, as `ollama run`)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(ns: argparse.Namespace):
    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, seed=_request_seed(ns), stop=ns.stop,
        output_kind=RequestOutputKind.DELTA,
    )


def _request_seed(ns: argparse.Namespace) -> int | None:
    """The given seed, else a fresh one: the engine's generator starts from --seed (0) in every
    process, so without this each run of `pagoda generate --temperature 0.8` told the same story."""
    if ns.sampling_seed is not None or ns.temperature == 0:
        return ns.sampling_seed
    return secrets.randbits(63)


def _stream(engine, prompt, params) -> str:
    """Run one request to the end, printing text as it arrives; returns the full text."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    parts = []
    try:
        for out in engine.outputs():
            for c in out.outputs:
                sys.stdout.write(c.text)
                sys.stdout.flush()
                parts.append(c.text)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    sys.stdout.write("\n")
    return "".join(parts)


def cmd_generate(ns: argparse.Namespace) -> int:
    from pagoda.engine.llm_engine import LLMEngine  # deferred: loads llguidance, tokenizers, torch

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    try:
        params = _sampling_params(ns)
        if ns.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
            prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
        else:
            prompt = ns.prompt
        _stream(engine, prompt, params)
        return 0
    finally:
        engine.shutdown()  # tensor-parallel ranks, if any


def cmd_run_batch(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai import run_batch  # deferred: loads torch, the engine and the server's request path

    return run_batch.main(ns)


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagoda.engine.llm_engine import LLMEngine  # deferred: loads llguidance, tokenizers, torch

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    try:
        return _chat(engine, ns)
    finally:
        engine.shutdown()  # tensor-parallel ranks, if any


def _chat(engine, ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print(f"pagoda chat with {ns.model} — type /exit to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit", "/bye"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            print("(conversation reset" + (", system prompt kept)" if ns.system else ")"), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages)
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
        try:
            reply = _stream(engine, prompt, params)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            messages.pop()
            continue
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(ns: argparse.Namespace) -> int:
    served_models.apply_model_tag(ns)  # `pagoda serve MODEL`
    tls.check_args(ns)  # --ssl-* files, and not with --data-parallel-size (pagoda/security/tls.py)
    if ns.ray_serve:
        ray_serve_options.check_args(ns)
        # deferred: loads ray, fastapi, torch and the server (pagoda --help stays light)
        from pagoda.ray_serve.app import run as run_ray_serve

        return run_ray_serve(ns)
    if served_models.serves_several(ns) and (ns.data_parallel_size != 1 or ns.data_parallel_rank is not None):
        raise ValueError("--data-parallel-size serves one model: give one --model (several models are served by "
                         "one process, loaded on first use)")
    # Before torch loads (replicas and a spawned engine process inherit it): how long OpenMP
    # workers spin between kernels, from how busy the cores are (pagoda/threads.py).
    configure_server_openmp(shared_cores=ns.data_parallel_size != 1 or ns.data_parallel_rank is not None
                            or getattr(ns, "tensor_parallel_size", 1) > 1)
    if ns.data_parallel_rank is not None:  # one replica of `--data-parallel-size N`
        # deferred: loads httpx, orjson, prometheus_client, starlette, uvicorn
        from pagoda.router.data_parallel import pin_replica

        pin_replica(ns.data_parallel_rank, ns.data_parallel_size)
    elif ns.data_parallel_size != 1:
        if ns.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
        # deferred: loads httpx, orjson, prometheus_client, starlette, uvicorn
        from pagoda.router.data_parallel import run_data_parallel

        return run_data_parallel(ns)
    # deferred: loads fastapi, jinja2, llguidance, numpy, orjson, pydantic, ray, starlette, tokenizers, torch, uvicorn
    from pagoda.entrypoints.openai.api_server import run_server

    return run_server(ns)


def cmd_router(ns: argparse.Namespace) -> int:
    return router_options.run(ns)


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    from pagoda.bench import throughput  # deferred: loads httpx, numpy, tokenizers, torch

    return throughput.main(ns, EngineArgs.from_cli_args(ns))


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from pagoda.bench import serve_command  # deferred: loads httpx, numpy, tokenizers

    return serve_command.main(ns)


def cmd_bench_plot(ns: argparse.Namespace) -> int:
    from pagoda.bench import plots  # deferred: keeps `pagoda` light at start

    for path in plots.main(ns.results, ns.plot_dir, ns.labels):
        print(path)
    return 0


def _add_bench_parser(sub) -> None:
    sub.add_parser("bench", help="benchmarks: offline throughput, serving load, concurrency sweeps",
                   populate=_populate_bench)


def _populate_bench(bench: argparse.ArgumentParser) -> None:
    """The bench subcommands; their options live in pagoda.bench, which imports numpy and asyncio,
    so this runs only when `pagoda bench ...` is parsed."""
    from pagoda.bench import serve, throughput  # deferred: loads httpx, numpy, tokenizers, torch

    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    p = bench_sub.add_parser("throughput", help="offline throughput through pagoda.LLM (and baselines)",
                             description=throughput.__doc__)
    EngineArgs.add_cli_args(p)
    throughput.add_cli_args(p)
    p.set_defaults(func=cmd_bench_throughput)

    p = bench_sub.add_parser("serve", help="load generator for an OpenAI-compatible server",
                             description=serve.__doc__)
    serve.add_cli_args(p)
    p.set_defaults(func=cmd_bench_serve)

    p = bench_sub.add_parser("plot", help="plot saved concurrency sweeps together (PNG)")
    p.add_argument("results", nargs="+", help="JSON files written by `pagoda bench serve --sweep-concurrency --save-result`")
    p.add_argument("--plot-dir", required=True)
    p.add_argument("--labels", nargs="+", default=None, help="names of the systems, in the order of the files")
    p.set_defaults(func=cmd_bench_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagoda", description="pagoda: LLM inference engine")
    parser.add_argument("--version", action="version", version=f"pagoda {__version__}")
    parser.add_argument("--log-level", dest="global_log_level", default=None, choices=LOG_LEVELS,
                        help=f"default: {DEFAULT_LOG_LEVEL} (serve: info); a command's own --log-level wins")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(p)
    _add_sampling_args(p)
    config_file.add_cli_arg(p)  # --config FILE.yaml (pagoda/config_file.py)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run-batch", help="run a Batch API file (JSONL requests) offline, as vLLM's run_batch")
    api_options.add_run_batch_args(p)  # -i, -o, --served-model-name, and the engine's options
    config_file.add_cli_arg(p)
    p.set_defaults(func=cmd_run_batch)

    p = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    _add_sampling_args(p)
    config_file.add_cli_arg(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    served_models.add_model_tag(p)  # `pagoda serve MODEL`, as `vllm serve MODEL`
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help="require this bearer token (also PAGODA_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="requests that may wait beyond the --max-num-seqs running ones; past that, 429 with "
                        "Retry-After (default: no bound)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the gRPC service pagoda.v1.Engine (with grpc.health.v1 and reflection) on "
                        "this port, on the same engine, API key and limits")
    api_options.add_serve_args(p)  # sessions, stored responses, --state-dir, batches, the output parsers
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine core in its own process instead of a thread (see benchmarks/README.md)")
    p.add_argument("--max-engine-restarts", type=int, default=3,
                   help="with --engine-process: how many times a dead engine process is restarted")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may live, queueing included; past it the request is aborted "
                        "and answered 504 (default: no limit)")
    router_options.add_shutdown_timeout_arg(p)  # `pagoda router`'s --shutdown-timeout too: one option, one default
    p.add_argument("--no-web-ui", action="store_true",
                   help="do not serve the web playground (/) and the engine dashboard (/dashboard); the JSON "
                        "debug API (/v1/debug/...) stays")
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                   help="default: the global --log-level (pagoda --log-level LEVEL serve), else info")
    EngineArgs.add_cli_args(p, overrides=served_models.model_option_overrides())  # --model repeatable
    served_models.add_serve_args(p)  # --models-file, --keep-alive, ... (pagoda/entrypoints/served_models.py)
    router_options.add_serve_args(p)
    ray_serve_options.add_serve_args(p)  # --ray-serve, --min-replicas, ... (pagoda/ray_serve/options.py)
    access_options.add_serve_args(p)  # --auth-config, --audit-log*, --read-timeout (pagoda/security/access.py)
    moderation.add_cli_args(p)  # --moderation-words / --moderation-action (pagoda/security/moderation.py)
    tls.add_cli_args(p)  # --ssl-keyfile / --ssl-certfile / --ssl-ca-certs (pagoda/security/tls.py)
    config_file.add_cli_arg(p)  # --config FILE.yaml, e.g. what `pagoda tune -o` wrote
    p.set_defaults(func=cmd_serve, default_log_level="info")

    p = sub.add_parser("router", help="one OpenAI-compatible endpoint in front of several `pagoda serve` replicas")
    router_options.add_cli_args(p)
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                   help="default: the global --log-level (pagoda --log-level LEVEL router), else info")
    p.set_defaults(func=cmd_router, default_log_level="info")

    store_commands.add_parsers(sub)  # the model store: list, pull, push, cp, show, rm, create (pagoda/store)
    encrypt_command.add_parser(sub)  # encrypted models at rest (pagoda/security)
    keys_command.add_parser(sub)  # `pagoda keys add|list|revoke` for --auth-config (pagoda/security)
    quantize_command.add_parser(sub)  # `pagoda quantize MODEL --method awq|gptq|rtn -o OUT.gguf` (pagoda/quantize)

    _add_bench_parser(sub)
    sub.add_parser("tune", help="find the serving flags with the most goodput under latency SLOs (measured trials)",
                   populate=_populate_tune)
    return parser


def _populate_tune(p: argparse.ArgumentParser) -> None:
    """`pagoda tune`'s options (pagoda/tune/command.py), added only when the command is parsed."""
    from pagoda.tune import command  # deferred: loads tokenizers

    p.description = command.__doc__
    EngineArgs.add_cli_args(p)  # the starting point; the tuned knobs move from there
    command.add_cli_args(p)
    p.set_defaults(func=command.main)


def resolve_log_level(ns: argparse.Namespace) -> str:
    """The command's own --log-level if given, else the global one (`pagoda --log-level X cmd`),
    else the command's default. The two options have separate dests: argparse copies every
    subcommand default over the global namespace, so one dest let serve's default win silently."""
    return getattr(ns, "log_level", None) or ns.global_log_level or getattr(ns, "default_log_level", DEFAULT_LOG_LEVEL)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = config_file.parse_args(parser, sys.argv[1:] if argv is None else argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # as given (serve --data-parallel-size passes it on)
    ns.log_level = resolve_log_level(ns)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
