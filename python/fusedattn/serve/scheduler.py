"""The server's engine worker: one thread that runs the requests in arrival order.

A handler submits a Job and reads its events (text deltas, then the finish)
from an asyncio queue that the worker fills across threads. A job whose client
went away is cancelled: the worker stops it at its next token (its KV cache is
freed with it) or skips it if it has not started. Requests run one at a time;
batching requests together is the continuous-batching step still to come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading

from ..engine import Engine, SamplingParams

__all__ = ["Finish", "Job", "Scheduler"]


@dataclasses.dataclass
class Finish:
    reason: str  # "stop" (end of text or a stop string) or "length" (max_tokens)
    completion_tokens: int
    error: str | None = None


@dataclasses.dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def emit(self, event: str | Finish) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._active = 0
        self._thread = threading.Thread(target=self._run, name="fusedattn-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def pool(self) -> dict:
        """What /health reports: requests running and waiting."""
        return {"running": self._active, "waiting": self._jobs.qsize()}

    def close(self) -> None:
        """Cancels nothing by itself: the server cancels its jobs, then closes."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            self._active = 1
            try:
                job.emit(self._serve(job))
            except Exception as e:  # noqa: BLE001  (the request fails; the server goes on)
                job.emit(Finish("error", 0, f"{type(e).__name__}: {e}"))
            finally:
                self._active = 0

    def _serve(self, job: Job) -> Finish:
        """Runs the job, emitting its text as it grows; a stop string ends it
        (and is not emitted), and text that may begin one is held back."""
        tokenizer = self.engine.tokenizer
        hold = max((len(s) for s in job.stop), default=1) - 1
        tokens: list[int] = []
        sent = 0
        steps = self.engine.generate([job.ids], job.max_tokens, job.sampling)
        try:
            for step in steps:
                if job.cancelled.is_set():
                    return Finish("cancelled", len(tokens))
                token = step[0]
                if token is None:
                    break
                tokens.append(token)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                hits = [i for i in (text.find(s) for s in job.stop) if i >= 0]
                if hits:
                    job.emit(text[sent:min(hits)])
                    return Finish("stop", len(tokens))
                ready = len(text) - hold
                while ready > sent and text[ready - 1] == "\ufffd":  # half of a multi-byte character
                    ready -= 1
                if ready > sent:
                    job.emit(text[sent:ready])
                    sent = ready
        finally:
            steps.close()
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > sent:
            job.emit(text[sent:])
        ended = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
        return Finish("stop" if ended or len(tokens) < job.max_tokens else "length", len(tokens))
