"""A request's text as its tokens arrive, and its stop strings (:class:`TextStops`).

Incremental detokenization (as vLLM and HF's ``TextStreamer`` do it): the text of the tokens since ``prefix`` minus
the text of the tokens up to ``read`` is the new text; a piece that ends in U+FFFD (a character whose bytes are
split over tokens) waits for the next token. Decoding a short window instead of the whole output keeps a token's
cost constant, and starting the window a few prompt tokens back gives the first token its leading space as the
tokenizer joins it.

Stop strings are matched on the text, so a stop string may span token boundaries. The text handed out stops before
a stop string (the OpenAI API's rule), and text that could still be the start of one is held back until a later
token rules it out (or the request ends for another reason: then it is released).
"""

from __future__ import annotations

__all__ = ["TextStops"]

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one (its leading space)


class TextStops:
    """The detokenized output of one request and its stop strings ``stops`` (a tuple, possibly empty)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_ids: list[int]):
        if not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"stop strings need a tokenizer with decode() (Engine(..., tokenizer=...)), got "
                             f"{type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens whose text is in self.text
        self.text = ""  # the output's text so far (cut before a stop string once one matched)
        self._handed = 0  # characters of self.text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> bool:
        """Adds one generated token; True when the text now contains a stop string (then cut before it)."""
        if self.stopped:
            raise ValueError("TextStops.push: the request already stopped")
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False  # (no new character yet: part of a multi-byte character, or a special token)
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if not self.stops:
            return False
        window = max(0, start - self._longest + 1)  # a match must end in the new text
        hits = [i for i in (self.text.find(s, window) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        text = self.text
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that no stop string can claim any more (``final``: the request ended, so
        everything left)."""
        if final and not self.stopped and self._read < len(self._ids):  # a character cut short by the end
            self.text += self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]
            self._prefix = self._read = len(self._ids)
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        piece = self.text[self._handed:end]
        self._handed = max(self._handed, end)
        return piece
