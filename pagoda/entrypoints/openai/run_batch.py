"""`pagoda run-batch -i in.jsonl -o out.jsonl --model M`: a Batch API file run offline, as
vLLM's run_batch: the engine and the server's request path without a server, every line's
answer (or error) written to the output in the input's order, in the Batch API's output format.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from pagoda.config import create_engine_config
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine_args import EngineArgs
from pagoda.entrypoints.openai.batch_lines import BatchLine, jsonl, output_line, parse_lines, run_line
from pagoda.entrypoints.openai.responses_store import ResponseStore
from pagoda.entrypoints.openai.serving import Serving

logger = logging.getLogger("pagoda.run_batch")


def read_input(path: str) -> bytes:
    return sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()


def main(args) -> int:
    lines, errors = parse_lines(read_input(args.input_file), None)
    for error in errors:
        print(f"line {error['line']}: {error['message']}", file=sys.stderr)
    if errors:
        return 2
    answers = asyncio.run(_run(args, lines))
    out = jsonl(answers)
    if args.output_file == "-":
        sys.stdout.buffer.write(out)
    else:
        Path(args.output_file).write_bytes(out)
    failed = sum(a["response"]["status_code"] != 200 for a in answers)
    logger.info("%d requests: %d answered, %d failed", len(answers), len(answers) - failed, failed)
    return 0


async def _run(args, lines: list[BatchLine]) -> list[dict]:
    engine_args = EngineArgs.from_cli_args(args)
    config = create_engine_config(engine_args)
    engine = AsyncLLM(config)
    try:
        name = (args.served_model_name or [engine_args.model])[0]
        serving = Serving(engine, [name, engine_args.model])
        store = ResponseStore(engine)  # previous_response_id within the file
        limit = asyncio.Semaphore(config.scheduler.max_num_seqs)

        async def one(line: BatchLine) -> dict:
            async with limit:
                status, body = await run_line(serving, store, line)
            return output_line(line, status, body)

        return await asyncio.gather(*(one(line) for line in lines))
    finally:
        engine.shutdown()
