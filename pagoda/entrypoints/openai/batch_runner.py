"""The server's batch jobs, run in the background: one job at a time, its lines at most
`--batch-concurrency` at once (batch_lines.py: at batch priority, below interactive work), each
answer kept in the state database as it comes, then the output and error files written.

Everything a job has done is in the database, so a restarted server resumes its unfinished jobs
where they stopped: the lines already answered are not run again. A job is cancelled between
lines (the lines running are aborted; what was answered goes into the files), and expires when
its completion window passes.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagoda.entrypoints.openai.admission import BACKGROUND_WORK
from pagoda.entrypoints.openai.batch_lines import BatchLine, jsonl, output_line, parse_lines, run_line
from pagoda.entrypoints.openai.files import FileStore
from pagoda.entrypoints.openai.responses_store import ResponseStore
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.state_db import StateDB
from pagoda.security.context import CURRENT, RequestContext

logger = logging.getLogger("pagoda.batches")
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


class BatchRunner:
    def __init__(self, serving: Serving, responses: ResponseStore, files: FileStore, db: StateDB,
                 concurrency: int) -> None:
        self.serving, self.responses, self.files, self.db = serving, responses, files, db
        self.concurrency = max(1, concurrency)
        self.queue: asyncio.Queue[tuple[str | None, str]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Run the queue; unfinished jobs of an earlier run of this server go first."""
        for tenant, batch_id, batch in self.db.all("batch"):
            if batch["status"] in UNFINISHED:
                logger.info("batch %s: resuming (%s)", batch_id, batch["status"])
                self.queue.put_nowait((tenant, batch_id))
        self._task = asyncio.get_running_loop().create_task(self._run_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def submit(self, tenant: str | None, batch_id: str) -> None:
        self.queue.put_nowait((tenant, batch_id))

    async def _run_forever(self) -> None:
        while True:
            tenant, batch_id = await self.queue.get()
            try:
                await self.run(tenant, batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad job must not stop the queue
                logger.exception("batch %s failed", batch_id)
                self._update(tenant, batch_id, status="failed", failed_at=int(time.time()),
                             errors={"object": "list", "data": [{"code": "server_error", "message": "internal error",
                                                                 "param": None, "line": None}]})

    # -- one job ----------------------------------------------------------------------------
    async def run(self, tenant: str | None, batch_id: str) -> None:
        batch = self.db.get("batch", tenant, batch_id)
        if batch is None or batch["status"] not in UNFINISHED:
            return
        content = self.files.content(batch["input_file_id"], tenant)
        lines, errors = parse_lines(content, batch["endpoint"])
        if errors:
            self._update(tenant, batch_id, status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": errors[:100]})
            return
        if batch["status"] == "validating":
            batch = self._update(tenant, batch_id, status="in_progress", in_progress_at=int(time.time()))
        counts = self._counts(batch_id, len(lines))
        self._update(tenant, batch_id, request_counts=counts)
        done = self.db.done_lines(batch_id)
        outcome = await self._run_lines(tenant, batch, [line for line in lines if line.number not in done])
        self._finish(tenant, batch_id, lines, outcome)

    async def _run_lines(self, tenant: str | None, batch: dict, todo: list[BatchLine]) -> str:
        """Run the lines; "completed", "cancelled" or "expired" as the job ends."""
        context = self._context(batch)
        running: set[asyncio.Task] = set()
        for line in todo:
            while len(running) >= self.concurrency:
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                self._progress(tenant, batch["id"])
            ending = self._ending(tenant, batch["id"])
            if ending:
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                return ending
            running.add(asyncio.get_running_loop().create_task(self._one(batch["id"], line, context)))
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        return self._ending(tenant, batch["id"]) or "completed"

    async def _one(self, batch_id: str, line: BatchLine, context: RequestContext | None) -> None:
        BACKGROUND_WORK.set(True)  # (this task's copy of the context only)
        if context is not None:
            CURRENT.set(context)  # the creator's role, tenant salt and limits
        self.serving.background += 1
        try:
            status, body = await run_line(self.serving, self.responses, line)
        finally:
            self.serving.background -= 1
        self.db.put_result(batch_id, line.number, status == 200, output_line(line, status, body))

    def _context(self, batch: dict) -> RequestContext | None:
        """The request context of the key that created the job (--auth-config), looked up now:
        a key revoked since then runs no more of it."""
        access = getattr(self.serving, "access", None)
        if access is None or batch.get("key_id") is None:
            return None
        return RequestContext(access.grant_for_key(batch["key_id"]), access.keep_content)

    def _ending(self, tenant: str | None, batch_id: str) -> str | None:
        batch = self.db.get("batch", tenant, batch_id)
        if batch["status"] == "cancelling":
            return "cancelled"
        if time.time() > batch["expires_at"]:
            return "expired"
        return None

    def _progress(self, tenant: str | None, batch_id: str) -> None:
        batch = self.db.get("batch", tenant, batch_id)
        self._update(tenant, batch_id, request_counts=self._counts(batch_id, batch["request_counts"]["total"]))

    def _counts(self, batch_id: str, total: int) -> dict:
        completed, failed = self.db.result_counts(batch_id)  # (each line's progress: the answers stay unread)
        return {"total": total, "completed": completed, "failed": failed}

    def _finish(self, tenant: str | None, batch_id: str, lines: list[BatchLine], outcome: str) -> None:
        """Write the output and error files (in input order) and end the job."""
        if outcome == "completed":
            self._update(tenant, batch_id, status="finalizing", finalizing_at=int(time.time()))
        results = self.db.results(batch_id)
        ok = [data for _, good, data in results if good]
        bad = [data for _, good, data in results if not good]
        fields: dict = {"request_counts": self._counts(batch_id, len(lines))}
        if ok:
            fields["output_file_id"] = self.files.add(jsonl(ok), f"{batch_id}_output.jsonl", "batch_output", tenant)["id"]
        if bad:
            fields["error_file_id"] = self.files.add(jsonl(bad), f"{batch_id}_error.jsonl", "batch_output", tenant)["id"]
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[outcome]
        self._update(tenant, batch_id, status=outcome, **{stamp: int(time.time())}, **fields)
        self.db.drop_results(batch_id)
        logger.info("batch %s %s: %s", batch_id, outcome, fields["request_counts"])

    def _update(self, tenant: str | None, batch_id: str, **fields) -> dict:
        batch = {**self.db.get("batch", tenant, batch_id), **fields}
        self.db.put("batch", tenant, batch_id, batch, batch["created_at"])
        return batch
