"""Incremental detokenization (UTF-8 safe) and stop-string matching with trimming, one sequence at a time."""

from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# A UTF-8 character has at most 4 bytes; a byte-level BPE token carries at least one, so a tail still
# undecodable after this many tokens is a real U+FFFD in the output, not a character cut in half.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns token ids, as they arrive, into text deltas.

    `tokenizers`' DecodeStream does the work in Rust: it decodes a small window (the tokens last shown, for
    context such as a leading space the tokenizer drops at the start of a string, plus the new ones) and emits
    what the window adds, holding tokens back while the window ends in U+FFFD (a multi-byte character cut
    between tokens). Two things it does not do are done here: a tail still undecodable after MAX_HELD_TOKENS
    tokens is a real U+FFFD and is emitted, and `flush` emits what is held when the sequence ends.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window of what is held
        self.read_offset = 0  # tokens before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """The text `token_ids` add, stepped one token at a time: what is held back, and so the text, then depends
        on the ids alone, not on how the worker chunked them (a stream and a whole response read the same)."""
        if len(token_ids) == 1:
            return self._step(token_ids[0])
        return "".join([self._step(token_id) for token_id in token_ids])

    def _step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        text = self.stream.step(self.tokenizer, token_id)
        if text is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return text
        if len(self.token_ids) - self.read_offset < MAX_HELD_TOKENS:
            return ""
        return self._emit_held()

    def flush(self) -> str:
        """Whatever is still held back (the sequence ended): emitted as is, U+FFFD included."""
        return self._emit_held() if self.read_offset < len(self.token_ids) else ""

    def _emit_held(self) -> str:
        context = self.token_ids[self.prefix_offset:self.read_offset]
        prefix_text = self._decode(context)
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        # The stream starts again after what is emitted now. Its context is the window before the held tokens
        # (which decodes cleanly): the stream computes a new token's text as what it adds to its context's.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.stream = DecodeStream(context, skip_special_tokens=self.skip_special_tokens)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Finds the first stop string in streamed text; text that could start a stop string is held back.

    `feed` returns the text safe to emit now and whether a stop string matched; on a match the stop
    string and everything after it are dropped (OpenAI semantics: the matched text is not returned).
    """

    def __init__(self, stop_strings: list[str]):
        self.stops = [s for s in stop_strings if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.buffer = ""
        self.matched: Optional[str] = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        self.buffer += text
        first: Optional[tuple[int, str]] = None
        for stop in self.stops:
            at = self.buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            out, self.buffer = self.buffer[:first[0]], ""
            return out, True
        keep = self._held_suffix_len()
        out = self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return out, False

    def _held_suffix_len(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of some stop string."""
        for length in range(min(self.max_len - 1, len(self.buffer)), 0, -1):
            tail = self.buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return "" if self.matched is not None else out
