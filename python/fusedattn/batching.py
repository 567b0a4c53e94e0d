"""Continuous batching: requests join and leave the engine between steps.

``Batcher(engine)`` holds the requests a server has admitted. Each ``step()``
is one call of the model: every running request adds its next tokens, one when
it decodes, a chunk of its prompt when it prefills, within the step's token
budget (decodes first, then prefills in the order they arrived), each at its
own length in the KV cache. A step that mixes prefill chunks and decodes is one
packed call (``Engine.forward_packed``); a step where every running request
decodes is ``Engine.decoder``'s step over their rows (a CUDA graph per row
count on CUDA). A request leaves when it samples a stop token or reaches its
``max_tokens``, or when it is cancelled, and its pages go back to the pool at
once.

The KV cache is a ``kv_pages.PagePool`` read through block tables (CPU and
CUDA kernels both take them). A request takes pages as it grows, and requests
whose tokens start the same share the pages of that prefix (prefix caching).
When a running request needs a page and none is free, the request admitted
last is preempted: its pages go back and it waits at the head of the queue to
be computed again from its tokens so far.
A waiting request is admitted when a row of the step and the pages of its
first chunk are free; nothing fails for want of pages but a request larger than the whole cache,
which ``add`` refuses.

Batching does not change a request's tokens: prompts are cut into chunks at
multiples of the kernel's query tile (the planner's ``block_m``), the model's
linear layers see row counts that are multiples of 8, and a shared page holds
only positions computed in whole query tiles of a prefill. So, on the CPU, a
greedy request gives the same bits alone, in any batch, and from cached pages
(``tests/test_batching.py``). A preempted request's recomputed keys come from a
prefill rather than decoding steps, which may change its last bits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

import torch
from torch import Tensor

from .engine import Engine, SamplingParams, adjust_logits, logit_bias_tensors, sample
from .kv_pages import PagePool, page_keys
from .ops import plan_kvcache

__all__ = ["Batcher", "Event", "Sequence"]


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request as the batcher holds it."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_tokens: frozenset[int]
    generator: torch.Generator | None  # None: greedy
    # [vocab]: how many times each token was sampled, while it runs with sampling that penalizes
    counts: Tensor | None
    logprobs: int | None = None  # each token's log-probability and this many top alternatives; None: off
    # With logprobs, where asked: entry j (j >= 1) is prompt token j's (log-probability, top
    # alternatives) as the logits of position j - 1 give them; None until computed.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    bias: tuple[Tensor, Tensor] | None = None  # its logit bias's ids and values on the device, while it runs
    tokens: list[int] = dataclasses.field(default_factory=list)  # sampled so far
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # positions whose keys and values are in its pages
    exact: int = 0  # positions computed in whole query tiles of a prefill: the pages it may share
    names: list[bytes] = dataclasses.field(default_factory=list)  # of its first pages (prefix caching)
    named: int = 0  # of its pages, the first this many are named in the pool
    slot: int | None = None  # its row of the step's call; None while it waits
    finish: str | None = None  # "stop", "length", "cancelled" or "error" once it has left

    def length(self) -> int:
        """Tokens whose keys it needs before it samples again."""
        return len(self.prompt) + len(self.tokens)

    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's positions are to be computed for their logprobs: until its first
        token, when they have been (a preempted request does not compute them again)."""
        return self.prompt_logprobs is not None and not self.tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.tokens[position - n]


@dataclasses.dataclass
class Event:
    """What one step did for one request: the token it sampled, and why it
    left (None: it goes on; "error": the step's call failed, and no token)."""

    sequence: Sequence
    token: int | None
    finish: str | None
    error: str | None = None
    # Where the request asked for logprobs: the token's log-probability under the model
    # (its raw logits' log-softmax, before logit bias, temperature, top-k/top-p and penalties), and
    # the most likely tokens' (token, log-probability), most likely first.
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def _query_tile(engine: Engine, page_size: int) -> int:
    """The query tile of packed calls against a paged cache, as the planner
    says for a call of one token; the plans refuse pages the kernels cannot
    read (on CUDA, a page size that is no multiple of 16)."""
    c, device, dtype = engine.config, engine.device, engine.dtype
    q = torch.zeros(1, c.heads, c.head_dim, device=device, dtype=dtype)
    caches = [torch.zeros(1, c.kv_heads, page_size, c.head_dim, device=device, dtype=dtype) for _ in range(2)]
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    plan_kvcache(q[:, :, None], *caches, lengths, block_table=table)  # the decode step's
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    return plan_kvcache(q, *caches, lengths, cu_seqlens_q=cu, block_table=table)["block_m"]


def _logprobs(logits: Tensor, tokens: list[int], tops: list[int]) -> list[tuple[float, list] | Exception]:
    """Per row of logits [R, vocab]: tokens[r]'s log-probability and the tops[r] most likely
    (token, log-probability), most likely first, in three copies to the host; an exception
    for a row whose log-probability is not finite, or for all where the computation fails."""
    try:
        logprobs = logits.float().log_softmax(-1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        k = min(max(tops), logprobs.shape[-1])
        best = logprobs.topk(k) if k > 0 else None
        indices, values = (best.indices.tolist(), best.values.tolist()) if best is not None else ([], [])
    except Exception as e:  # noqa: BLE001  (e.g. a device error: these rows fail)
        return [e] * len(tokens)
    found: list[tuple[float, list] | Exception] = []
    for r, (token, top) in enumerate(zip(tokens, tops)):
        if not math.isfinite(chosen[r]):
            found.append(ValueError(f"token {token}'s log-probability is {chosen[r]}: the logits are not finite"))
        else:
            found.append((chosen[r], list(zip(indices[r][:top], values[r][:top])) if top else []))
    return found


def _row_counts(max_running: int) -> list[int]:
    """The row counts of decoding steps with CUDA graphs: 1, 2, 4, 8, then
    every multiple of 8, and max_running."""
    counts = {n for n in (1, 2, 4) if n < max_running} | set(range(8, max_running, 8)) | {max_running}
    return sorted(counts)


class Batcher:
    """The running and waiting requests of one engine, stepped together."""

    def __init__(self, engine: Engine, max_running: int = 32, kv_positions: int = 16384, page_size: int = 16,
                 token_budget: int = 512, prefix_caching: bool = True):
        """max_running: requests in one step at most. kv_positions: the paged
        cache's size in positions (of every layer). page_size: positions a
        page holds (on CUDA a multiple of 16). token_budget: tokens one step
        computes at most (at least max_running and one query tile).
        prefix_caching: share pages of equal prefixes."""
        for name, value in (("max_running", max_running), ("kv_positions", kv_positions), ("page_size", page_size),
                            ("token_budget", token_budget)):
            if value < 1:
                raise ValueError(f"fusedattn.batching: {name} must be at least 1, got {value}")
        self.engine = engine
        c = engine.config
        self.query_tile = _query_tile(engine, page_size)
        # Room for every running request's token and one query tile, so decoding never starves a prefill.
        self.token_budget = max(token_budget, max_running + self.query_tile)
        # With CUDA graphs, decoding steps run at a few row counts (each one
        # graph, captured here): the rows past the requests' decode a token 0
        # into spare pages, a page each, which no request holds.
        self._row_counts = _row_counts(max_running) if engine.cuda_graph else []
        spare = max_running if self._row_counts else 0
        # The kernels read a sequence's written positions only: unused pages need no zeros.
        self.pool = PagePool(c.layers, c.kv_heads, c.head_dim, math.ceil(kv_positions / page_size), page_size,
                             engine.device, engine.dtype, zeroed=False, spare=spare)
        # A request holds at most the model's context and at most every page.
        self._table = torch.zeros(max_running, min(math.ceil(c.context / page_size), self.pool.pages),
                                  dtype=torch.int32)
        spare_pages = torch.arange(self.pool.pages, self.pool.caches[0][0].shape[0], dtype=torch.int32)
        self._spare_rows = spare_pages[:, None].expand(-1, self._table.shape[1])
        self._free_slots = collections.deque(range(max_running))
        self._decoders: dict[int, tuple] = {}  # rows -> (lengths, block_table, step) of Engine.decoder
        for rows in self._row_counts:
            self._decode_rows([], rows)  # the decoder's first call runs eagerly, then captures
        self.prefix_caching = prefix_caching
        # Shared pages end where a query tile does, so that their keys are the
        # bits a request computing them itself would get.
        self._share_unit = math.lcm(page_size, self.query_tile)
        self.max_running = max_running
        self._running: list[Sequence] = []  # in the order they were admitted
        self._waiting: collections.deque[Sequence] = collections.deque()
        self.preemptions = 0

    # ----- requests

    def add(self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None,
            stop_tokens: set[int] | frozenset[int] = frozenset(), logprobs: int | None = None,
            prompt_logprobs: bool = False) -> Sequence:
        """Queues a request; it runs from the next step on that has room. logprobs: each
        event of it carries its token's log-probability and this many alternatives';
        prompt_logprobs (with logprobs): the prompt's tokens get theirs too, in the
        request's prompt_logprobs, filled by the time it samples (its prefill then shares no
        page of a cached prefix, whose positions it would not compute)."""
        if prompt_logprobs and logprobs is None:
            raise ValueError("fusedattn.batching: prompt_logprobs needs logprobs (the alternatives' count)")
        self.check(len(prompt), max_tokens)
        sampling = sampling or SamplingParams()
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self.engine.device).manual_seed(sampling.seed)
        seq = Sequence(list(prompt), max_tokens, sampling, frozenset(stop_tokens), generator, None, logprobs,
                       [None] * len(prompt) if prompt_logprobs else None)
        self._waiting.append(seq)
        return seq

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate: its
        positions must fit the model's context and the whole KV cache (below 1:
        the prompt alone does not)."""
        return min(self.engine.config.context, self.pool.pages * self.pool.page_size) - prompt_tokens + 1

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError where a request of these sizes could never run."""
        context = self.engine.config.context
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError(f"fusedattn.batching: a request needs a prompt of at least one token and max_tokens "
                             f">= 1, got {prompt_tokens} tokens and max_tokens={max_tokens}")
        last = prompt_tokens + max_tokens - 1  # positions whose keys it may cache
        if last > context:
            raise ValueError(f"fusedattn.batching: the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) "
                             f"exceed the model's context of {context} tokens")
        if math.ceil(last / self.pool.page_size) > self.pool.pages:
            raise ValueError(f"fusedattn.batching: the request needs {math.ceil(last / self.pool.page_size)} pages "
                             f"of the KV cache, which has {self.pool.pages}")

    def cancel(self, seq: Sequence) -> None:
        """Ends a request now (its pages go back); nothing where it has ended."""
        if seq.finish is None:
            self._leave(seq, "cancelled")

    def counts(self) -> dict:
        """Requests running and waiting, preemptions so far, and the pages of the cache."""
        return {"running": len(self._running), "waiting": len(self._waiting), "preemptions": self.preemptions,
                "kv_pages": self.pool.usage()}

    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    # ----- one step

    def step(self) -> list[Event]:
        """Runs one packed call of every request that has room; returns what
        each sampled. Where the model's call fails, the requests of the step
        leave with finish "error" (their events carry the error, no token);
        where a request's sampling fails, that request does."""
        batch = sorted(self._schedule(), key=lambda item: item[0].slot)  # the call's order
        if not batch:
            return []
        try:
            logits, prompt_rows = self._run(batch)
        except Exception as e:  # noqa: BLE001  (these requests fail; the others go on)
            error = f"{type(e).__name__}: {e}"
            for seq, _ in batch:
                self._leave(seq, "error")
            return [Event(seq, None, "error", error) for seq, _ in batch]
        samplers = []  # the requests that sample: their logits rows, in order
        for seq, n in batch:
            if seq.cached == seq.exact:  # its whole query tiles are exact too (a decoding token fills none)
                seq.exact = (seq.cached + n) // self.query_tile * self.query_tile
            seq.cached += n
            self._name_pages(seq)
            if seq.cached == seq.length():  # else more of its prompt is to come
                samplers.append(seq)
        events = self._note_prompt_logprobs(logits[len(samplers):], prompt_rows)
        logits = logits[:len(samplers)]
        going = [row for row, seq in enumerate(samplers) if seq.finish is None]  # not failed in their prompt rows
        if len(going) < len(samplers):
            logits, samplers = logits[going], [samplers[row] for row in going]
        tokens = self._sample(logits, samplers)
        wanted = [i for i, (seq, token) in enumerate(zip(samplers, tokens))
                  if seq.logprobs is not None and not isinstance(token, Exception)]
        logprobs = dict(zip(wanted, _logprobs(logits[wanted], [tokens[i] for i in wanted],
                                              [samplers[i].logprobs for i in wanted]))) if wanted else {}
        for i, (seq, token) in enumerate(zip(samplers, tokens)):
            logprob, top = None, None
            try:
                if isinstance(token, Exception):
                    raise token
                if i in logprobs:
                    if isinstance(logprobs[i], Exception):
                        raise logprobs[i]
                    logprob, top = logprobs[i]
                if seq.counts is not None:
                    seq.counts[token] += 1
            except Exception as e:  # noqa: BLE001  (e.g. NaN logits: this request fails, the others go on)
                events.append(self._fail(seq, e))
                continue
            seq.tokens.append(token)
            finish = ("stop" if token in seq.stop_tokens else
                      "length" if len(seq.tokens) == seq.max_tokens else None)
            if finish is not None:
                self._leave(seq, finish)
            events.append(Event(seq, token, finish, logprob=logprob, top=top))
        return events

    def _note_prompt_logprobs(self, logits: Tensor, prompt_rows: list[tuple[Sequence, int]]) -> list[Event]:
        """Each prompt row's (request, position) gets its token's log-probability from its
        logits row; a request whose computation fails leaves with an error event."""
        if not prompt_rows:
            return []
        events = []
        found = _logprobs(logits, [seq.prompt[position] for seq, position in prompt_rows],
                          [seq.logprobs for seq, _ in prompt_rows])
        for (seq, position), logprob in zip(prompt_rows, found):
            if seq.finish is not None:  # failed at an earlier row of this step
                continue
            if isinstance(logprob, Exception):
                events.append(self._fail(seq, logprob))
            else:
                seq.prompt_logprobs[position] = logprob
        return events

    def _fail(self, seq: Sequence, error: Exception) -> Event:
        """seq leaves with finish "error"; its event says why."""
        self._leave(seq, "error")
        return Event(seq, None, "error", f"{type(error).__name__}: {error}")

    def _sample(self, logits: Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """seqs[i]'s token from logits row i, with its logit bias and penalties: the greedy ones
        from one argmax (one copy to the host), the others each drawn with its
        own generator; an exception in place of a token where that fails (a
        greedy row that is not finite too)."""
        tokens: list[int | Exception] = [0] * len(seqs)
        rows: dict[int, Tensor] = {}  # the rows that a logit bias or penalties change
        for i, seq in enumerate(seqs):
            if seq.sampling.adjusts_logits():
                try:
                    counts = self._counts(seq) if seq.sampling.penalizes() else None
                    if seq.sampling.logit_bias and seq.bias is None:
                        seq.bias = logit_bias_tensors(seq.sampling, self.engine.config.vocab, self.engine.device)
                    rows[i] = adjust_logits(logits[i], seq.sampling, counts, seq.bias)
                except Exception as e:  # noqa: BLE001  (this request's failure, returned)
                    tokens[i] = e
        greedy = [i for i, seq in enumerate(seqs) if seq.generator is None and not isinstance(tokens[i], Exception)]
        if greedy:
            try:
                if rows:
                    chosen_rows = torch.stack([rows[i] if i in rows else logits[i] for i in greedy])
                else:
                    chosen_rows = logits if len(greedy) == len(seqs) else logits[greedy]
                chosen, finite = torch.stack([chosen_rows.argmax(-1), chosen_rows.isfinite().all(-1)]).tolist()
                chosen = [t if ok else ValueError("the logits are not finite") for t, ok in zip(chosen, finite)]
            except Exception as e:  # noqa: BLE001  (e.g. a device error: these requests fail)
                chosen = [e] * len(greedy)
            for i, token in zip(greedy, chosen):
                tokens[i] = token
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not isinstance(tokens[i], Exception):
                try:
                    row = rows[i] if i in rows else logits[i]
                    tokens[i] = int(sample(row[None], seq.sampling, seq.generator)[0])
                except Exception as e:  # noqa: BLE001  (this request's failure, returned)
                    tokens[i] = e
        return tokens

    def _counts(self, seq: Sequence) -> Tensor:
        """seq's counts of its tokens so far, made when it first samples after admission."""
        if seq.counts is None:
            tokens = torch.tensor(seq.tokens, dtype=torch.long, device=self.engine.device)
            seq.counts = torch.bincount(tokens, minlength=self.engine.config.vocab).float()
        return seq.counts

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens seq computes within budget: the rest of what it needs, else
        up to a multiple of the query tile (chunks start on one)."""
        rest = seq.length() - seq.cached
        if rest <= budget:
            return rest
        return max((seq.cached + budget) // self.query_tile * self.query_tile - seq.cached, 0)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """The step's (request, tokens): decoding requests first, then prefill
        chunks in the order the requests came, then newly admitted ones."""
        batch, budget, preempted = [], self.token_budget, set()
        decoding = [seq for seq in self._running if seq.length() - seq.cached == 1]
        prefilling = [seq for seq in self._running if seq.length() - seq.cached > 1]
        for seq in decoding + prefilling:
            n = self._chunk(seq, budget) if seq.slot is not None else 0  # preempted in this loop: no slot
            if n and self._grow(seq, seq.cached + n, batch, preempted):
                batch.append((seq, n))
                budget -= n
        while self._waiting and budget > 0 and len(self._running) < self.max_running:
            seq = self._waiting[0]
            if seq in preempted:  # not back in the step that made room by preempting it
                break
            self._share_prefix(seq)
            n = self._chunk(seq, min(budget, self._room(seq)))
            if n == 0:
                self._give_back(seq)  # the shared pages wait with it, idle
                break
            self._waiting.popleft()
            self._admit(seq)
            self._grow(seq, seq.cached + n, batch, preempted)
            batch.append((seq, n))
            budget -= n
        return batch

    def _run(self, batch: list[tuple[Sequence, int]]) -> tuple[Tensor, list[tuple[Sequence, int]]]:
        """The model over the batch's tokens (in slot order): the logits of the requests that
        sample, then those of the prompt rows of requests that want prompt_logprobs, and for
        each of the latter (request, the prompt position whose token its logits predict)."""
        if len(batch) == len(self._running) and all(n == 1 and seq.length() == seq.cached + 1 for seq, n in batch):
            return self._run_decode([seq for seq, _ in batch]), []
        slots = self.max_running
        counts, cached = [0] * slots, [0] * slots
        ids, positions, rows, prompt_rows = [], [], [], []
        for seq, n in batch:
            counts[seq.slot], cached[seq.slot] = n, seq.cached
            if seq.wants_prompt_logprobs():  # position p's logits give prompt token p + 1's
                prompt_rows.extend((seq, len(ids) + p - seq.cached, p + 1)
                                   for p in range(seq.cached, min(seq.cached + n, len(seq.prompt) - 1)))
            positions.extend(range(seq.cached, seq.cached + n))
            ids.extend(seq.token_at(p) for p in range(seq.cached, seq.cached + n))
            if seq.cached + n == seq.length():
                rows.append(len(ids) - 1)
        rows += [row for _, row, _ in prompt_rows]
        device = self.engine.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        cu = as_tensor(list(itertools.accumulate(counts, initial=0)))
        logits = self.engine.forward_packed(as_tensor(ids).long(), as_tensor(positions).long(), cu,
                                            as_tensor(cached), self.pool.caches, self._table.to(device),
                                            torch.tensor(rows, dtype=torch.long, device=device))
        return logits, [(seq, position) for seq, _, position in prompt_rows]

    def _run_decode(self, seqs: list[Sequence]) -> Tensor:
        """A step where every running request decodes: Engine.decoder's step
        over their rows (with CUDA graphs, the smallest captured row count
        that holds them)."""
        rows = next((n for n in self._row_counts if n >= len(seqs)), len(seqs))
        return self._decode_rows(seqs, rows)[:len(seqs)]

    def _decode_rows(self, seqs: list[Sequence], rows: int) -> Tensor:
        """The decoder of ``rows`` rows (one per row count, made at first use),
        its lengths and block table refilled in place: seqs' first, then rows
        of a token 0 at position 0 of a spare page each."""
        if rows not in self._decoders:
            device = self.engine.device
            lengths = torch.zeros(rows, dtype=torch.int32, device=device)
            table = torch.zeros(rows, self._table.shape[1], dtype=torch.int32, device=device)
            self._decoders[rows] = lengths, table, self.engine.decoder(lengths, self.pool.caches, table)
        lengths, table, step = self._decoders[rows]
        padding = rows - len(seqs)
        spare = self._spare_rows[:padding]
        lengths.copy_(torch.tensor([seq.cached for seq in seqs] + [0] * padding, dtype=torch.int32))
        table.copy_(torch.cat([self._table[[seq.slot for seq in seqs]], spare]))
        tokens = [seq.token_at(seq.cached) for seq in seqs] + [0] * padding
        return step(torch.tensor(tokens, device=self.engine.device))

    # ----- slots and pages

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self._free_slots.popleft()
        self._table[seq.slot, :len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        self._running.append(seq)

    def _room(self, seq: Sequence) -> int:
        """Positions a waiting seq could hold now: its shared pages and the free ones."""
        return (len(seq.pages) + self.pool.available()) * self.pool.page_size - seq.cached

    def _pages_short(self, seq: Sequence, positions: int) -> int:
        """Pages seq would need to hold ``positions``, beyond those the pool has free."""
        return math.ceil(positions / self.pool.page_size) - len(seq.pages) - self.pool.available()

    def _grow(self, seq: Sequence, positions: int, batch: list, preempted: set) -> bool:
        """Gives seq the pages of ``positions``, preempting the requests
        admitted last that are not in the batch yet while the pool is short;
        False where seq itself was preempted."""
        in_batch = {s for s, _ in batch}
        while self._pages_short(seq, positions) > 0:
            victim = next(s for s in reversed(self._running) if s not in in_batch)  # seq at the latest
            self._preempt(victim)
            preempted.add(victim)
            if victim is seq:
                return False
        while len(seq.pages) * self.pool.page_size < positions:
            seq.pages.append(self.pool.take())
            self._table[seq.slot, len(seq.pages) - 1] = seq.pages[-1]
        return True

    def _share_prefix(self, seq: Sequence) -> None:
        """Takes the named pages of seq's first tokens (whole units of the
        page and the query tile, and never its last token, whose logits it needs)."""
        if not self.prefix_caching or seq.pages or seq.wants_prompt_logprobs():
            return
        unit, size = self._share_unit, self.pool.page_size
        candidates = (seq.length() - 1) // unit * unit // size
        page_keys(seq.prompt + seq.tokens, size, candidates, seq.names)
        shared = []
        for name in seq.names[:candidates]:
            page = self.pool.share(name)
            if page is None:
                break
            shared.append(page)
        keep = len(shared) * size // unit * unit // size
        for page in shared[keep:]:
            self.pool.give_back(page)
        seq.pages, seq.named = shared[:keep], keep
        seq.cached = seq.exact = keep * size

    def _name_pages(self, seq: Sequence) -> None:
        """Names seq's full pages of exactly computed positions (prefix caching)."""
        if not self.prefix_caching:
            return
        full = seq.exact // self.pool.page_size
        if seq.named < full:
            page_keys(seq.prompt + seq.tokens, self.pool.page_size, full, seq.names)
            for i in range(seq.named, full):
                self.pool.name(seq.pages[i], seq.names[i])
            seq.named = full

    def _give_back(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.pool.give_back(page)
        seq.pages, seq.cached, seq.exact, seq.named = [], 0, 0, 0
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self._running.remove(seq)
        self._give_back(seq)
        seq.counts = seq.bias = None  # a waiting request holds no device memory but its pages'
        self._waiting.appendleft(seq)

    def _leave(self, seq: Sequence, finish: str) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._give_back(seq)
        seq.counts = seq.bias = None
        seq.finish = finish
