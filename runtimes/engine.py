"""The serving engine: many sequences on one Session, continuously batched.

A worker thread runs turns. At the start of each, waiting requests join (up to ``max_active``
sequences in flight) and cancelled sequences (their client went away) leave. Then every sequence
still in its prompt feeds one piece of it (``prefill`` for the first, ``extend`` for the others,
cut as ``Session.extend`` cuts them), so a long prompt never stalls the others for more than a
piece; and every other sequence decodes one token. With a bundle compiled for serving (a sequence
pool: ``k3c compile --max-batch``) a sequence's state moves into the pool after its prompt, the
pooled sequences kept in its first slots (one that leaves has its slot filled by the last), and
they all take one decode step together, reading the weights once for all of them; without a pool
each decodes on its own, its state buffers kept here. Either way
each sequence computes what it computes alone, up to float rounding (a batch of B runs the kernels
compiled for B rows): the same prompt pieces, its own positions and its own seeded sampler.
Every IREE call happens on the worker thread.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import K3Error
from .sampling import Sampler
from .session import extend_pieces
from .tokenizer import TextStream


class QueueFull(K3Error):
    """The engine holds as many waiting requests as it may."""


@dataclass
class Event:
    """What one step of a sequence produced, handed to the request's ``on_event`` (worker thread)."""
    text: str = ""                                  # new text to show ("" while held back)
    token: int | None = None
    logprob: float | None = None                    # of ``token`` under the model's distribution
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None                # stop, length; set on a sequence's last event
    error: str | None = None                        # the step failed; the sequence is gone


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    on_event: Callable[[Event], None]
    stops: tuple[str, ...] = ()
    top_logprobs: int | None = None                 # None: no log-probabilities; k: the chosen and k others
    logit_bias: dict[int, float] = field(default_factory=dict)   # added to the logits before the choice


@dataclass
class Sequence:
    request: Request
    stream: TextStream
    pieces: deque                                   # prompt pieces still to feed
    state: tuple | None = None                      # its state buffers, until it moves into the pool
    position: int = 0                               # tokens its state holds
    slot: int | None = None                         # its slot of the sequence pool
    ids: list[int] = field(default_factory=list)
    cancelled: bool = False


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def active_limit(pool, max_active: int | None) -> int:
    """Sequences in flight at once: ``max_active``, by default the pool's size (8 without a pool);
    never more than the pool holds."""
    if max_active is None:
        return pool.max_batch if pool else 8
    if pool and max_active > pool.max_batch:
        raise K3Error(f"serve: --max-active {max_active} is more than the {pool.max_batch} sequences of the "
                      f"bundle's pool (its --max-batch)")
    return max_active


class Engine:
    """Up to ``max_active`` sequences in flight (at most the pool's slots), up to ``max_queue`` more
    waiting for a place."""

    def __init__(self, session, tokenizer, max_active: int | None = None, max_queue: int = 64,
                 on_decode: Callable[[int], None] = lambda batch: None):
        """``on_decode(n)`` is told the size of every decode step (worker thread)."""
        self.session, self.tokenizer, self.on_decode = session, tokenizer, on_decode
        self.pool = session.pool
        self.max_active, self.max_queue = active_limit(self.pool, max_active), max_queue
        self.context = min(session.max_context, self.pool.context) if self.pool else session.max_context
        self.pooled: list[Sequence] = []               # the pooled sequences, sequence i in slot i (worker only)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._worker = threading.Thread(target=self._run, name="k3c-engine", daemon=True)
        self._worker.start()

    def submit(self, request: Request) -> Sequence:
        """Queue ``request``; QueueFull when every place is taken and ``max_queue`` requests wait."""
        if not request.prompt_ids:
            raise K3Error("the prompt is empty")
        if len(request.prompt_ids) >= self.context:
            raise K3Error(f"the prompt has {len(request.prompt_ids)} tokens; the context holds "
                          f"{self.context}, and at least one must be left to generate")
        ids = self.session.check_ids(request.prompt_ids)
        self.session.check_ids(list(request.logit_bias))
        max_prompt = self.session.bundle.manifest.max_prompt
        pieces = deque([ids[:max_prompt]] + (extend_pieces(ids[max_prompt:], max_prompt) if ids.size > max_prompt else []))
        seq = Sequence(request, TextStream(self.tokenizer, request.stops), pieces)
        with self._wake:
            if len(self.waiting) + len(self.active) >= self.max_active + self.max_queue:
                raise QueueFull(f"the server is full: {len(self.active)} sequences run and "
                                f"{len(self.waiting)} requests wait")
            self.waiting.append(seq)
            self._wake.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq`` at the next turn (or before it starts); its state and slot go with it."""
        with self._wake:
            seq.cancelled = True
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._worker.join()

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def occupancy(self) -> int:
        return len(self.active)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.active and not self.waiting:
                    self._wake.wait()
                if self._stopped:
                    return
                self.waiting = deque(s for s in self.waiting if not s.cancelled)
                while self.waiting and len(self.active) < self.max_active:
                    self.active.append(self.waiting.popleft())
                turn = [s for s in self.active if not s.cancelled]
                done = [s for s in self.active if s.cancelled]
            self._leave(done)     # before the step: a cancelled sequence's slot takes another
            decoding = [s for s in turn if not s.pieces]
            done += [s for s in turn if s.pieces and self._prompt_piece(s)]
            finished = self._decode(decoding)
            self._leave(finished)
            with self._wake:
                for seq in done + finished:
                    self.active.remove(seq)
                    seq.state = None

    def _leave(self, seqs: list[Sequence]) -> None:
        """Take ``seqs`` out of the pool, highest slot first, each slot left filled by the pool's last
        sequence, so the pooled sequences stay in the first slots. A move the device fails ends
        every pooled sequence with that error (they leave at the next turn)."""
        for seq in sorted((q for q in seqs if q.slot is not None), key=lambda q: -q.slot):
            hole, last = seq.slot, self.pooled.pop()
            seq.slot = None
            if last is seq:
                continue
            try:
                self.session.move(last.slot, hole)
            except K3Error as e:
                for q in [last, *self.pooled]:
                    q.request.on_event(Event(error=str(e)))
                    q.slot, q.cancelled = None, True
                self.pooled.clear()
                return
            last.slot, self.pooled[hole] = hole, last

    def _prompt_piece(self, seq: Sequence) -> bool:
        """Feed ``seq``'s next prompt piece; after its last, choose its first token and (with a
        pool) move its state into the next free slot. Whether it has finished."""
        s = self.session
        s.state, s.position = seq.state, seq.position
        try:
            piece = seq.pieces.popleft()
            logits = (s.prefill(piece, last_only=True)[0] if seq.state is None else s.extend(piece, True))[-1]
        except K3Error as e:
            seq.request.on_event(Event(error=str(e)))
            return True
        finally:
            seq.state, seq.position = s.state, s.position
            s.state = None
        if seq.pieces:
            return False
        return self._choose(seq, logits) or (self.pool is not None and not self._put(seq))

    def _put(self, seq: Sequence) -> bool:
        """Move ``seq``'s state into the pool's next free slot; False when the device failed it."""
        s = self.session
        s.state, s.position = seq.state, seq.position
        try:
            s.put(len(self.pooled))
        except K3Error as e:
            seq.request.on_event(Event(error=str(e)))
            return False
        finally:
            s.state = None
        seq.state, seq.slot = None, len(self.pooled)
        self.pooled.append(seq)
        return True

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode step of each sequence that has its prompt fed (its last id fed): with a pool
        all pooled ones in one call, else each of ``seqs`` in turn. Those that finished."""
        if self.pool:
            return self._decode_pooled()
        done = []
        for seq in seqs:
            s = self.session
            s.state, s.position = seq.state, seq.position
            try:
                logits = s.decode(seq.ids[-1])
            except K3Error as e:
                seq.request.on_event(Event(error=str(e)))
                done.append(seq)
                continue
            finally:
                seq.state, seq.position = s.state, s.position
                s.state = None
            self.on_decode(1)
            if self._choose(seq, logits):
                done.append(seq)
        return done

    def _decode_pooled(self) -> list[Sequence]:
        if not self.pooled:
            return []
        group = list(self.pooled)
        try:
            logits = self.session.decode_pooled([q.ids[-1] for q in group], [q.position for q in group])
        except K3Error as e:
            for seq in group:
                seq.request.on_event(Event(error=str(e)))
            return group
        self.on_decode(len(group))
        done = []
        for seq, row in zip(group, logits):
            seq.position += 1
            if self._choose(seq, row):
                done.append(seq)
        return done

    def _choose(self, seq: Sequence, logits: np.ndarray) -> bool:
        r = seq.request
        if r.logit_bias:
            logits = np.array(logits, dtype=np.float32)
            for token_id, bias in r.logit_bias.items():
                logits[token_id] += bias
        token = r.sampler(logits)
        seq.ids.append(token)
        event = Event(token=token)
        if r.top_logprobs is not None:
            lp = log_softmax(logits)
            event.logprob = float(lp[token])
            top = np.argsort(-lp, kind="stable")[:r.top_logprobs]
            event.top_logprobs = [(int(i), float(lp[i])) for i in top]
        if token in self.tokenizer.eos_ids:       # the end of the answer, not a part of its text
            event.finish_reason = "stop"
        else:
            event.text, stopped = seq.stream.feed(token)
            if stopped:
                event.finish_reason = "stop"
            elif len(seq.ids) >= r.max_tokens or seq.position + 1 >= self.context:
                event.finish_reason = "length"
        if event.finish_reason:
            event.text += seq.stream.finish()
        r.on_event(event)
        return event.finish_reason is not None
