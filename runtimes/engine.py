"""The serving engine: many sequences on one Session, taking turns step by step.

The compiled module runs one sequence per call (batch 1; the state goes in and comes out as device
buffers), so the engine keeps each sequence's state buffers and position itself and a worker
thread runs the sequences round robin, one step each per turn: a prompt piece (``prefill`` for the
first, ``extend`` for the others, cut as ``Session.extend`` cuts them) or one ``decode`` step. A
request joins between steps, a long prompt is fed one piece per turn so it does not stall the
others, and a sequence leaves the moment it finishes or is cancelled (its client went away). Each
sequence computes exactly what it computes alone: the same pieces, the same steps, its own seeded
sampler. Every IREE call happens on the worker thread.
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
    state: tuple | None = None
    position: int = 0
    ids: list[int] = field(default_factory=list)
    cancelled: bool = False


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


class Engine:
    """``max_active`` sequences take turns; up to ``max_queue`` more wait for a place."""

    def __init__(self, session, tokenizer, max_active: int = 8, max_queue: int = 64):
        self.session, self.tokenizer = session, tokenizer
        self.max_active, self.max_queue = max_active, max_queue
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
        if len(request.prompt_ids) >= self.session.max_context:
            raise K3Error(f"the prompt has {len(request.prompt_ids)} tokens; the context holds "
                          f"{self.session.max_context}, and at least one must be left to generate")
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
        """Drop ``seq`` at its next turn (or before it starts); its state buffers go with it."""
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
                turn = list(self.active)
            for seq in turn:
                done = seq.cancelled or self._step(seq)
                if done:
                    with self._wake:
                        self.active.remove(seq)
                    seq.state = None

    def _step(self, seq: Sequence) -> bool:
        """One step of ``seq``; whether it has finished."""
        s = self.session
        s.state, s.position = seq.state, seq.position
        try:
            if seq.pieces:
                piece = seq.pieces.popleft()
                logits = (s.prefill(piece, last_only=True)[0] if seq.state is None else s.extend(piece, True))[-1]
                if seq.pieces:
                    return False        # its state is kept below
            else:
                logits = s.decode(seq.ids[-1])
        except K3Error as e:
            seq.request.on_event(Event(error=str(e)))
            return True
        finally:
            seq.state, seq.position = s.state, s.position
            s.state = None
        return self._choose(seq, logits)

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
            elif len(seq.ids) >= r.max_tokens or seq.position + 1 >= self.session.max_context:
                event.finish_reason = "length"
        if event.finish_reason:
            event.text += seq.stream.finish()
        r.on_event(event)
        return event.finish_reason is not None
