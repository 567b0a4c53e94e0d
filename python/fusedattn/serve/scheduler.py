"""The server's engine worker: one thread that steps every request together.

A handler submits a Job and reads its events (text deltas, each after a list of
the TokenLogprobs of its tokens where the job asked for them, then the finish)
from an asyncio queue that the worker fills across threads. Between two steps
of the ``fusedattn.batching.Batcher`` the worker admits the jobs that arrived
and drops those whose client went away (their pages go back at once); each
step then decodes a token of every running request and prefills a chunk of the
newest ones (continuous batching), and each request's new text goes to its job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading

from ..batching import Batcher, Sequence
from ..engine import Engine, SamplingParams
from ..text_stream import StopText

__all__ = ["SHUTTING_DOWN", "Finish", "Job", "Scheduler", "TokenLogprob"]

SHUTTING_DOWN = "the server is shutting down"  # the error of the requests a close() ends


@dataclasses.dataclass
class Finish:
    reason: str  # "stop" (end of text or a stop string), "length" (max_tokens) or "error"
    completion_tokens: int
    error: str | None = None


@dataclasses.dataclass
class TokenLogprob:
    """A token's log-probability, sent before the text it is part of."""
    token: int
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: list[tuple[int, float]] | None  # the most likely tokens' (token, log-probability)
    offset: int  # where its text starts in the reply's


@dataclasses.dataclass
class Job:
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None  # a TokenLogprob per token of the reply, with this many alternatives
    echo: str | None = None  # the prompt's text, sent first (with logprobs, after its tokens' TokenLogprobs)
    echo_offsets: list[int] | None = None  # where each prompt token's text starts in echo
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def emit(self, event: str | list[TokenLogprob] | Finish) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    def __init__(self, engine: Engine, **batching):
        """batching: fusedattn.batching.Batcher's options (max_running, kv_positions, ...)."""
        self.engine = engine
        self.batcher = Batcher(engine, **batching)
        self._inbox: queue.Queue[Job | None] = queue.Queue()
        # The worker thread's alone: each request's job, text and TokenLogprobs not sent yet.
        self._jobs: dict[Sequence, tuple[Job, StopText, list[TokenLogprob]]] = {}
        self._counts = self.batcher.counts()  # the worker's last snapshot, for /health
        self._closing, self._closed = threading.Lock(), False
        self._thread = threading.Thread(target=self._run, name="fusedattn-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._closing:  # a job after close() would wait for a worker that has gone
            if self._closed:
                job.emit(Finish("error", 0, SHUTTING_DOWN))
            else:
                self._inbox.put(job)

    def pool(self) -> dict:
        """What /health reports: requests running and waiting (the submitted
        ones not yet admitted among them), preemptions, and the KV cache's
        pages, as of the engine's last step."""
        counts = self._counts
        return {**counts, "waiting": counts["waiting"] + self._inbox.qsize()}

    def close(self) -> None:
        """Ends the worker; jobs still running or queued get an error finish."""
        with self._closing:
            self._closed = True
            self._inbox.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while self._admit():
            try:
                self._step()
            except Exception as e:  # noqa: BLE001  (a fault of the worker's own: its requests fail, it goes on)
                for seq in list(self._jobs):
                    try:
                        self._end(seq, Finish("error", len(seq.tokens), f"{type(e).__name__}: {e}"))
                    except Exception:  # noqa: BLE001  (the worker must outlive any one request)
                        self._jobs.pop(seq, None)
            self._counts = self.batcher.counts()
        for seq in list(self._jobs):
            self._end(seq, Finish("error", len(seq.tokens), SHUTTING_DOWN))
        while not self._inbox.empty():
            job = self._inbox.get()
            if job is not None:
                job.emit(Finish("error", 0, SHUTTING_DOWN))
        self._counts = self.batcher.counts()

    def _step(self) -> None:
        for seq, (job, *_) in list(self._jobs.items()):
            if job.cancelled.is_set():  # its client went away
                self._end(seq)
        for event in self.batcher.step():
            seq = event.sequence
            job, text, pending = self._jobs[seq]
            if event.finish == "error":
                self._end(seq, Finish("error", len(seq.tokens), event.error))
                continue
            offset = text.offset()
            try:
                if job.echo is not None and len(seq.tokens) == 1:
                    self._echo(job, seq)
                delta, stopped = text.push(event.token)
            except Exception as e:  # noqa: BLE001  (this request fails; the others go on)
                self._end(seq, Finish("error", len(seq.tokens), f"{type(e).__name__}: {e}"))
                continue
            if event.logprob is not None:
                pending.append(TokenLogprob(event.token, event.logprob, event.top, offset))
            if event.finish is not None and not stopped:
                delta += text.rest()
            # The tokens whose text starts in what is sent go before it; at the end all of them,
            # but those a stop string cut off (the end-of-text token, which has none, included).
            self._release(job, pending, text.sent if stopped or event.finish is None or text.stopped else None)
            if delta:
                job.emit(delta)
            if stopped or event.finish is not None:
                self._end(seq, Finish("stop" if stopped or text.stopped else event.finish, len(seq.tokens)))

    @staticmethod
    def _release(job: Job, pending: list[TokenLogprob], before: int | None) -> None:
        """Sends the pending TokenLogprobs whose text starts before `before` in the reply's
        text (None: all), their offsets counted from the echoed prompt's start where there is one."""
        count = len(pending) if before is None else sum(1 for t in pending if t.offset < before)
        if count:
            shift = len(job.echo or "")
            job.emit([dataclasses.replace(entry, offset=entry.offset + shift) for entry in pending[:count]])
            del pending[:count]

    @staticmethod
    def _echo(job: Job, seq: Sequence) -> None:
        """The prompt's text, after its tokens' TokenLogprobs where the job asked for logprobs."""
        if seq.prompt_logprobs is not None:
            if any(entry is None for entry in seq.prompt_logprobs[1:]):
                raise RuntimeError("the prompt's log-probabilities were not all computed")
            job.emit([TokenLogprob(token, *(entry or (None, None)), offset)
                      for token, entry, offset in zip(seq.prompt, seq.prompt_logprobs, job.echo_offsets)])
        if job.echo:
            job.emit(job.echo)

    def _admit(self) -> bool:
        """Adds the jobs that arrived (waiting for one while nothing runs);
        False once the server closes."""
        block = not self.batcher.busy()
        while True:
            try:
                job = self._inbox.get(block=block)
            except queue.Empty:
                self._counts = self.batcher.counts()  # the admitted jobs count as waiting or running now
                return True
            if job is None:
                return False
            block = False
            if job.cancelled.is_set():
                continue
            try:
                seq = self.batcher.add(job.ids, job.max_tokens, job.sampling, self.engine.stop_tokens(),
                                       job.logprobs, prompt_logprobs=job.echo is not None and job.logprobs is not None)
            except Exception as e:  # noqa: BLE001  (the app checked the sizes: anything else fails this job)
                job.emit(Finish("error", 0, f"{type(e).__name__}: {e}"))
                continue
            self._jobs[seq] = (job, StopText(self.engine.tokenizer, job.stop), [])

    def _end(self, seq: Sequence, finish: Finish | None = None) -> None:
        """Takes seq out of the batch (its pages go back) and sends finish, if
        any, to its job, after /health's snapshot: a client that has its answer
        sees its pages back in the pool."""
        self.batcher.cancel(seq)
        job, *_ = self._jobs.pop(seq)
        self._counts = self.batcher.counts()
        if finish is not None:
            job.emit(finish)
