"""Detokenise accepted tokens into a text stream, honouring stop strings.

Text is decoded from all generated ids each round (a few hundred ids decode in microseconds
with a fast tokenizer) so multi-byte characters split across tokens come out whole. A delta
is held back while it ends in an incomplete character or in what may be the start of a stop
string, so a stream never shows text that a stop string later cuts.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # text of token_ids, cut at a stop string once one is found
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the newly final text. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        start = len(self.token_ids)
        self.token_ids.extend(tokens)
        self.text = self._decode(self.token_ids)
        if self.stop:
            self._cut_at_stop(start)
        return self._release()

    def finish(self) -> str:
        """The rest of the text, held back or not, once generation ends."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest

    def _cut_at_stop(self, first_new_token: int) -> None:
        longest = max(len(s) for s in self.stop)
        # Only text that the new tokens touched (plus a stop string's length) can hold a new match.
        prior = len(self._decode(self.token_ids[:first_new_token])) if first_new_token else 0
        search_from = max(0, prior - longest + 1)
        hits = [(i, len(s), s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return
        cut, length, self.matched = min(hits)
        self.stopped = True
        self.text = self.text[:cut]
        # Keep the tokens up to the one that completes the stop string: what one-token passes
        # would have generated when they saw it, so completion_tokens do not depend on how many
        # tokens a pass accepted.
        for n in range(first_new_token + 1, len(self.token_ids) + 1):
            if len(self._decode(self.token_ids[:n])) >= cut + length:
                self.token_ids = self.token_ids[:n]
                break

    def _release(self) -> str:
        end = len(self.text)
        if self.stopped:
            pass  # the text is final
        else:
            if end > self.sent and self.text.endswith("\ufffd"):
                end -= 1  # an incomplete multi-byte character
            for s in self.stop:  # a possible beginning of a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text[end - k : end] == s[:k]:
                        end -= k
                        break
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
