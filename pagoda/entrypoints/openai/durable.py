"""What a server keeps beyond one request, on one state database (state_db.py): `/v1/sessions`
conversations, stored responses, the Batch API's files and jobs. `install_durable_state` builds
them for an app, includes their routes, and starts and stops their background work with it."""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from pagoda.entrypoints.openai.batch_runner import BatchRunner
from pagoda.entrypoints.openai.batches import router as batches_router
from pagoda.entrypoints.openai.chat_sessions import ChatSessionStore
from pagoda.entrypoints.openai.files import FileStore
from pagoda.entrypoints.openai.files import router as files_router
from pagoda.entrypoints.openai.responses import router as responses_router
from pagoda.entrypoints.openai.responses_store import ResponseStore
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.state_db import StateDB

logger = logging.getLogger("pagoda.server")
# Batch lines at once by default: a batch decode step of 32 keeps an interactive first token
# near its idle time at most of the batch's throughput (benchmarks/README.md, "Batch work and
# interactive latency").
DEFAULT_BATCH_CONCURRENCY = 32


@dataclass
class DurableOptions:
    state_dir: str | Path | None = None  # None: a temporary directory, removed when the app stops
    session_ttl: float = 1800.0
    max_sessions: int = 1000
    max_stored_responses: int = 10000
    batch_concurrency: int | None = None  # batch lines at once; None: DEFAULT_BATCH_CONCURRENCY


def install_durable_state(app: FastAPI, serving: Serving, options: DurableOptions) -> None:
    temporary = options.state_dir is None
    directory = Path(tempfile.mkdtemp(prefix="pagoda-state-")) if temporary else Path(options.state_dir)
    db = StateDB(directory)
    engine = serving.engine
    fingerprint = engine.config.model.name  # whose tokenizer made the token ids a record keeps
    app.state.sessions = sessions = ChatSessionStore(serving, options.session_ttl, options.max_sessions, db,
                                                     fingerprint)
    app.state.responses = responses = ResponseStore(engine, options.session_ttl, options.max_stored_responses, db,
                                                    fingerprint)
    app.state.files = files = FileStore(db)
    concurrency = options.batch_concurrency or min(DEFAULT_BATCH_CONCURRENCY, engine.config.scheduler.max_num_seqs)
    app.state.batches = batches = BatchRunner(serving, responses, files, db, concurrency)
    for part in (sessions, responses, batches):
        app.router.on_startup.append(part.start)
        app.router.on_shutdown.append(part.stop)

    def close() -> None:
        db.close()
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)

    app.router.on_shutdown.append(close)
    app.include_router(responses_router)  # /v1/responses (responses.py)
    app.include_router(files_router)  # /v1/files (files.py)
    app.include_router(batches_router)  # /v1/batches (batches.py)
    logger.info("state (sessions, stored responses, batches): %s", "in memory" if temporary else directory)
