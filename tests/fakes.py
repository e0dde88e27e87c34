"""Test doubles shared by the fast tests: a scripted engine, and the real app served in-process."""
from __future__ import annotations

import threading
import time

from werkzeug.serving import make_server

from chat import app_state
from chat.concurrency import real_sleep, start_real_thread
from chat.engine import Delta, Done, Engine, Generation, Queued, Refused, Started
from chat.engine.events import Splitter
from chat.errors import Overloaded, PromptTooLong

WORDS = [f"w{i} " for i in range(40)]


class FakeEngine(Engine):
    """Answers with scripted words from a real thread, one per ``delay``.

    Honours cancel, stop sequences, max tokens and a time limit; with ``slots``
    it runs that many at once and queues the rest (``max_queue``, then Overloaded);
    with ``seeded``, a seed and a temperature above 0 rotate the words, so seeds differ.
    """

    model_name = "fake-model"

    def __init__(self, words=WORDS, delay=0.0, fail_after=None, ready=True, answer_words=None,
                 slots=None, max_queue=0, timeout_s=None, context_words=None, seeded=False, thinking=False):
        self.words, self.delay, self.fail_after = list(words), delay, fail_after
        self.answer_words = len(self.words) if answer_words is None else answer_words
        self.ready = ready
        self.slots, self.max_queue, self.timeout_s = slots, max_queue, timeout_s
        self.context_words, self.seeded = context_words, seeded
        self.thinking = thinking  # a thinking model: its words split by thinking.Splitter, as the engines split them
        self.refuse = None  # an EngineError that submit raises
        self.reject = None  # an EngineError sent as a Refused event instead of Started
        self.history: list[Generation] = []
        self.accepting = True
        self._active = 0
        self._waiting: list[Generation] = []
        self._lock = threading.Lock()

    def submit(self, messages, params, key=None, owner=None):
        """Record the request and answer it on a real thread."""
        if self.refuse is not None:
            raise self.refuse
        if not self.accepting:
            raise Overloaded("the server is shutting down")
        if self.context_words is not None and len(messages[-1]["content"].split()) > self.context_words:
            raise PromptTooLong(f"the message does not fit in the model's context of {self.context_words} words")
        gen = Generation(messages=messages, params=params, key=key, owner=owner)
        with self._lock:
            if self.slots is not None and self._active >= self.slots:
                if len(self._waiting) >= self.max_queue:
                    raise Overloaded("the server is at capacity; try again shortly")
                self._waiting.append(gen)
            self._active += 1
        self.history.append(gen)
        start_real_thread(self._run, gen)
        return gen

    def _wait_for_slot(self, gen) -> bool:
        """Queue until a slot frees (telling the position); False if cancelled meanwhile."""
        told = None  # the position last told
        while True:
            with self._lock:
                if gen not in self._waiting:
                    return True
                position = self._waiting.index(gen) + 1
                running = self._active - len(self._waiting)
                if running < self.slots and position == 1:
                    self._waiting.remove(gen)
                    return True
                if gen.cancel_reason:
                    self._waiting.remove(gen)
                    return False
            if told != position:
                told = position
                gen.emit(Queued(position))
            real_sleep(0.005)

    def _answer(self, gen) -> list[str]:
        p = gen.params
        shift = (p.seed or 0) % len(self.words) if self.seeded and p.temperature > 0 else 0
        words = self.words[shift:] + self.words[:shift]
        return [words[i % len(words)] for i in range(self.answer_words)]

    def _run(self, gen):
        try:
            if self.slots is not None and not self._wait_for_slot(gen):
                gen.emit(Done(gen.cancel_reason))
            elif self.reject is not None:
                gen.emit(Refused(self.reject.code, self.reject.message))
            else:
                gen.emit(self._generate(gen))
        finally:
            with self._lock:
                self._active -= 1

    def _generate(self, gen) -> Done:
        """Stream the answer; its Done."""
        prompt = len(gen.messages)
        gen.emit(Started(prompt))
        text, first, reason, message = "", None, None, None
        answer = self._answer(gen)
        split = Splitter() if self.thinking else None
        for i, word in enumerate(answer[:gen.params.max_new_tokens]):
            real_sleep(self.delay)
            if gen.cancel_reason:
                reason = gen.cancel_reason
            elif self.timeout_s is not None and time.monotonic() - gen.submitted_at > self.timeout_s:
                reason = "timeout"
            elif self.fail_after is not None and i >= self.fail_after:
                reason, message = "error", "scripted failure"
            if reason:
                break
            cut = [(text + word).find(s) for s in gen.params.stop if s in text + word]
            piece = (text + word)[:min(cut)][len(text):] if cut else word
            if piece and split is not None:
                first = first or time.monotonic()
                thought, said = split.push(piece)
                if thought or said:
                    gen.emit(Delta(said, reasoning=thought))
            elif piece:
                first = first or time.monotonic()
                gen.emit(Delta(piece))
            text += piece
            if cut:
                reason = "stop"
                break
        else:
            reason = "stop" if gen.params.max_new_tokens >= len(answer) else "length"
        if split is not None:
            thought, said = split.flush()
            if thought or said:
                gen.emit(Delta(said, reasoning=thought))
        return Done.build(reason, prompt, len(text.split()), gen.submitted_at, first, message=message)

    def stats(self):
        return {"active": self._active, "queued": len(self._waiting)}

    def drain(self):
        self.accepting = False

    def shutdown(self, reason="shutdown"):
        self.accepting = False
        for gen in list(self.history):
            gen.cancel(reason)


class AppServer:
    """The app served by werkzeug's threaded server on a free port, in a thread of this process."""

    def __init__(self, app):
        self.app = app
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def state(self):
        return app_state(self.app)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
