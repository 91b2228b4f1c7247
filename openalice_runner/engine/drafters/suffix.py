"""Suffix drafting across requests (in the spirit of SuffixDecoding and Arctic Inference).

An agent loop's calls copy their own history (tool results, earlier replies: prompt lookup finds
those) and also what other calls of the same kind produced: the same JSON keys, the same code
scaffolding, the same phrasing of a summary. So besides this request's own tokens the drafter
looks the current suffix up in the recent responses of all requests of its tenant
(`RecentResponses`, one per tenant: `TenantResponses`, fed as tokens are accepted, so concurrent
requests see each other's output too). Never across tenants: an accepted draft is one more token
in that pass, which a stream's rhythm shows, so a store shared by tenants would let one read the
other's replies (arXiv 2411.01076 leaks a REST datastore this way). The
longer match wins; the draft's length follows the match's confidence, learnt separately for
own and cross-request matches (per matched length: `AcceptanceByMatch`) and weighed against the
pass's cost exactly as the n-gram drafter does. Drafts are plain token chains, verified like any
other: greedy output equals the target's, sampling keeps its distribution.

Cross-request matches need at least `MIN_SHARED_MATCH` tokens: one shared token says little
about what follows in another conversation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import torch

from openalice_runner.engine.cost_model import PassCostModel
from openalice_runner.engine.drafters.ngram import AcceptanceByMatch, NgramDrafter
from openalice_runner.engine.types import SamplingParams

MIN_SHARED_MATCH = 3
SHARED_MATCH_MAX = 8  # longest suffix looked up across requests
KEEP_RESPONSES = 64  # recent responses kept for cross-request drafting
KEEP_OCCURRENCES = 4  # per n-gram, the latest occurrences (a request skips its own)


class RecentResponses:
    """The generated tokens of the latest responses, with an n-gram index over them (thread-safe)."""

    def __init__(self, keep: int = KEEP_RESPONSES, n_min: int = MIN_SHARED_MATCH, n_max: int = SHARED_MATCH_MAX):
        self.keep, self.n_min, self.n_max = keep, n_min, n_max
        self._responses: deque[tuple[int, list[int]]] = deque()
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(response, end)]
        self._next_id = 0
        self._lock = threading.Lock()

    def open(self) -> int:
        """A new response; returns its handle (the oldest beyond `keep` is forgotten)."""
        with self._lock:
            handle = self._next_id
            self._next_id += 1
            self._responses.append((handle, []))
            if len(self._responses) > self.keep:
                self._responses.popleft()
                self._rebuild()
            return handle

    def extend(self, handle: int, tokens: list[int]) -> None:
        with self._lock:
            response = self._find(handle)
            if response is None:  # forgotten already
                return
            for token in tokens:
                response.append(token)
                end = len(response)
                # an n-gram is published with the token after it: the continuation must exist
                for n in range(self.n_min, self.n_max + 1):
                    if end - 1 >= n:
                        self._add(tuple(response[end - 1 - n : end - 1]), handle, end - 1)

    def match(self, context: list[int], max_tokens: int, exclude: int | None) -> tuple[list[int], int]:
        """(continuation, matched length) of the longest suffix of `context` found in a response
        other than `exclude`, latest occurrence first; ([], 0) without one."""
        with self._lock:
            for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
                for handle, end in reversed(self._index.get(tuple(context[-n:]), ())):
                    if handle == exclude:
                        continue
                    response = self._find(handle)
                    if response is not None and end < len(response):
                        return response[end : end + max_tokens], n
        return [], 0

    def _add(self, gram: tuple[int, ...], handle: int, end: int) -> None:
        seen = self._index.setdefault(gram, [])
        seen.append((handle, end))
        if len(seen) > KEEP_OCCURRENCES:
            del seen[0]

    def _find(self, handle: int) -> list[int] | None:
        for h, response in reversed(self._responses):
            if h == handle:
                return response
        return None

    def _rebuild(self) -> None:
        self._index = {}
        for handle, response in self._responses:
            for end in range(1, len(response)):
                for n in range(self.n_min, min(self.n_max, end) + 1):
                    self._add(tuple(response[end - n : end]), handle, end)


MAX_TENANT_STORES = 64  # tenants whose stores are kept, the least recently used dropped first


class TenantResponses:
    """One RecentResponses per tenant (None: requests without one), at most `max_tenants` of them."""

    def __init__(self, max_tenants: int = MAX_TENANT_STORES, **store_args) -> None:
        self.max_tenants = max_tenants
        self._store_args = store_args
        self._stores: OrderedDict[str | None, RecentResponses] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, tenant: str | None) -> RecentResponses:
        with self._lock:
            store = self._stores.get(tenant)
            if store is None:
                store = self._stores[tenant] = RecentResponses(**self._store_args)
                while len(self._stores) > self.max_tenants:
                    self._stores.popitem(last=False)
            self._stores.move_to_end(tenant)
            return store

    def __len__(self) -> int:
        return len(self._stores)


class SuffixDrafter(NgramDrafter):
    """Prompt lookup over this request's tokens, and suffix lookup over recent responses."""

    name = "suffix"

    def __init__(self, shared: RecentResponses, n_min: int = 1, n_max: int = 4,
                 costs: PassCostModel | None = None, probe_every: int = 8):
        super().__init__(n_min, n_max, costs, probe_every)
        self.shared = shared
        self.shared_acceptance = AcceptanceByMatch()
        self._handle: int | None = None
        self._published = 0  # tokens of the history handed to `shared`
        self._from_shared = False

    def start(self, prompt: list[int]) -> None:
        super().start(prompt)
        self._handle = self.shared.open()
        self._published = len(prompt)

    def propose(self, history: list[int], gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None):
        if self._handle is not None and len(history) > self._published:
            self.shared.extend(self._handle, history[self._published :])
            self._published = len(history)
        return super().propose(history, gamma, sampling, generator)

    def _match(self, history: list[int], gamma: int) -> tuple[list[int], int]:
        own, n = super()._match(history, gamma)
        self._from_shared = False
        if n < self.index.n_max:
            other, m = self.shared.match(history, gamma, exclude=self._handle)
            if m > n:
                self._from_shared = True
                return other, m
        return own, n

    def _estimates(self) -> AcceptanceByMatch:
        return self.shared_acceptance if self._from_shared else self.acceptance

    def _best_length(self, n: int, k_max: int) -> tuple[int, float]:
        own, self.acceptance = self.acceptance, self._estimates()
        try:
            return super()._best_length(n, k_max)
        finally:
            self.acceptance = own

    def update(self, history: list[int], proposed: int, accepted: int) -> None:
        own, self.acceptance = self.acceptance, self._estimates()
        try:
            super().update(history, proposed, accepted)
        finally:
            self.acceptance = own
