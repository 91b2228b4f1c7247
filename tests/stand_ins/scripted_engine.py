"""An engine with fixed replies, shared by the tests of the local provider, the README's library
example and examples/agent_loop.py.

Prompts are rendered and tokenized by the tiny model's real tokenizer and chat template (and its
grammars are the real ones); only the generated text is fixed, so the provider's tool-call
parsing, streaming and the loop around it run for real on known output.
"""

from __future__ import annotations

import threading

from openalice_runner.engine.types import GenerationResult, GenerationStats, StreamEvent
from stand_ins.engines import tiny_engine

# The tool call's arguments (the prompt ends inside the call block), then the answer from its result:
# the weather turn of the README's example and examples/agent_loop.py.
WEATHER_ANSWERS = ['Paris"}}\n', "It is 21 degrees and sunny in Paris."]
GATE_TIMEOUT_S = 120.0  # longer than any test waits with the gate shut


class GateNeverOpened(AssertionError):
    """A gated call whose gate the test never opened."""


class ScriptedEngine:
    """`answers`: the reply of each call in turn (one string: the same reply every call; past the
    list's end the last one again). `pieces`: how a stream hands the reply out (default: in one)."""

    model_name = "scripted"

    def __init__(self, answers: str | list[str], pieces: list[str] | None = None, completion_tokens: int = 7) -> None:
        real = tiny_engine()
        self.tokenizer = real.tokenizer
        self._real = real
        self.answers = [answers] if isinstance(answers, str) else list(answers)
        self.pieces = pieces
        self.completion_tokens = completion_tokens
        self.prompts: list[list[int]] = []  # each call's prompt token ids (`prompt_texts` decodes them)
        self.calls: list[tuple] = []  # each call's (sampling, spec)
        self.grammars_used: list = []  # the grammar each call was given (the text is fixed all the same)
        # set: each call waits for it first, `entered` set on the way in. The wait is bounded only
        # so that a test that never opens the gate fails (GateNeverOpened) rather than hangs: the
        # call never goes on as if it had opened
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.paced: threading.Semaphore | None = None  # set: one piece per release
        self.yielded = 0  # pieces handed out so far
        self.finish_reason = "stop"

    @property
    def text(self) -> str:
        """The reply the next call gives."""
        return self.answers[min(len(self.prompts), len(self.answers) - 1)]

    @property
    def prompt_texts(self) -> list[str]:
        return [self.tokenizer.decode(ids) for ids in self.prompts]

    def render_chat(self, messages, tools=None):
        return self._real.render_chat(messages, tools)

    def encode(self, text):
        return self._real.encode(text)

    @property
    def grammars(self):
        return self._real.grammars

    def _result(self, text, prompt_ids, spec):
        stats = GenerationStats(
            method=spec.method, gamma=spec.gamma, prompt_tokens=len(prompt_ids), completion_tokens=self.completion_tokens
        )
        stats.finish_reason = self.finish_reason
        return GenerationResult(text, [1] * self.completion_tokens, stats)

    def stream(self, prompt_ids, sampling, spec, cancel=None, grammar=None, step_policy=None):
        text = self.text
        self.prompts.append(prompt_ids)
        self.calls.append((sampling, spec))
        self.grammars_used.append(grammar)
        if self.gate is not None:
            self.entered.set()
            if not self.gate.wait(GATE_TIMEOUT_S):
                raise GateNeverOpened(f"the test did not open the engine's gate within {GATE_TIMEOUT_S:g} s")
        for piece in self.pieces or [text]:
            if self.paced is not None:
                assert self.paced.acquire(timeout=5), "the test released too few pieces"
            self.yielded += 1
            yield StreamEvent(piece, [1])
        yield StreamEvent("", [], result=self._result(text, prompt_ids, spec))

    def generate(self, prompt_ids, sampling, spec, cancel=None, grammar=None):
        result = None
        for event in self.stream(prompt_ids, sampling, spec, cancel, grammar):
            result = event.result or result
        return result
