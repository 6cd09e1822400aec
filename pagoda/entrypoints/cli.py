"""The `pagoda` command: generate | chat | serve | pull | list | bench."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from pagoda.config import DEFAULT_MODEL


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory, .gguf file, catalog name, or hub repo id (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache budget in GiB (CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat-template", default=None, help="a chat template, or a file holding one")
    g.add_argument("--enforce-eager", action="store_true", help="never compile the model (overrides --compile)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model between attention layers (cached in $PAGODA_HOME/inductor; "
                        "off by default: measured no faster on a 2-core AVX2 CPU)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share prompt prefixes between requests through a radix tree (default: on)")
    g.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "gguf"],
                   help="weight-only quantization in ggml blocks on pagoda's CPU kernels: int8 = Q8_0, "
                        "int4 = Q4_1 (head Q8_0); gguf keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks as stored, the "
                        "fast way to run a quantized GGUF (default: none, weights dequantized to the dtype)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed", help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _engine_args(ns: argparse.Namespace):
    from pagoda.config import EngineArgs

    return EngineArgs(
        model=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, block_size=ns.block_size,
        kv_cache_memory=ns.kv_cache_memory, gpu_memory_utilization=ns.gpu_memory_utilization,
        seed=ns.seed, chat_template=ns.chat_template, enforce_eager=ns.enforce_eager, compile=ns.compile,
        enable_prefix_caching=ns.enable_prefix_caching, quantization=ns.quantization,
    )


def _sampling_params(ns: argparse.Namespace):
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed, stop=ns.stop,
        output_kind=RequestOutputKind.DELTA,
    )


def _stream(engine, prompt, params) -> str:
    """Run one request to the end, printing text as it arrives; returns the full text."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    parts = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
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
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(_engine_args(ns))
    params = _sampling_params(ns)
    if ns.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
        prompt = {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    else:
        prompt = ns.prompt
    _stream(engine, prompt, params)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(_engine_args(ns))
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


def cmd_pull(ns: argparse.Namespace) -> int:
    from pagoda.loader import catalog

    path = catalog.pull(ns.name)
    print(path)
    return 0


def cmd_list(ns: argparse.Namespace) -> int:
    from pagoda.loader import catalog

    rows = catalog.list_models()
    print(f"{'NAME':<24} {'ALIASES':<12} {'SIZE':>8}  {'PULLED':<6}  PATH")
    for r in rows:
        size = f"{r['size'] / 2**20:.0f} MB" if r.get("size") else "-"
        print(f"{r['name']:<24} {','.join(r['aliases']) or '-':<12} {size:>8}  {'yes' if r['pulled'] else 'no':<6}  {r['path'] or '-'}")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.api_server import run_server

    return run_server(ns)


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    from pagoda.bench import throughput

    return throughput.main(ns, _engine_args(ns))


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from pagoda.bench import serve

    return serve.main(ns)


def cmd_bench_plot(ns: argparse.Namespace) -> int:
    from pagoda.bench import plots

    for path in plots.main(ns.results, ns.plot_dir, ns.labels):
        print(path)
    return 0


def _add_bench_parser(sub) -> None:
    from pagoda.bench import serve, throughput

    bench = sub.add_parser("bench", help="benchmarks: offline throughput, serving load, concurrency sweeps")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    p = bench_sub.add_parser("throughput", help="offline throughput through pagoda.LLM (and baselines)",
                             description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_args(p)
    throughput.add_cli_args(p)
    p.set_defaults(func=cmd_bench_throughput)

    p = bench_sub.add_parser("serve", help="load generator for an OpenAI-compatible server",
                             description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_cli_args(p)
    p.set_defaults(func=cmd_bench_serve)

    p = bench_sub.add_parser("plot", help="plot saved concurrency sweeps together (PNG)")
    p.add_argument("results", nargs="+", help="JSON files written by `pagoda bench serve --sweep-concurrency --save-result`")
    p.add_argument("--plot-dir", required=True)
    p.add_argument("--labels", nargs="+", default=None, help="names of the systems, in the order of the files")
    p.set_defaults(func=cmd_bench_plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: LLM inference engine")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    p.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help="require this bearer token (also PAGODA_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=None, help="requests in flight before 429")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine core in its own process instead of a thread (see benchmarks/README.md)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("pull", help="download a catalog model into the local store")
    p.add_argument("name")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="list catalog models and what is pulled")
    p.set_defaults(func=cmd_list)

    _add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
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
