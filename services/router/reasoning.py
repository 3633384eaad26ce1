"""--reasoning-parser: split a chat output's <think>…</think> reasoning from its content, streaming or whole."""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningParser:
    """Feed text as it streams; get back (reasoning, content) that is safe to emit.

    qwen3: the output is reasoning only when it opens with <think> (with enable_thinking false the template
    writes an empty think block itself and the model's output is all content). deepseek_r1: the template
    opens the think block, so the output is reasoning from its first token (a leading <think> is dropped)
    until </think>; an output that never closes it is all reasoning."""

    def __init__(self, kind: str):
        if kind not in ("qwen3", "deepseek_r1"):
            raise ValueError(f"unknown reasoning parser {kind!r}")
        self.kind = kind
        self.state = "start"  # start → reasoning → content
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_START):
                self.buffer, self.state = head[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(head):
                return "", ""  # an empty or partial <think>: wait for more
            else:
                self.state = "reasoning" if self.kind == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = self.buffer.find(THINK_END)
            if at < 0:
                keep = _held_prefix(self.buffer, THINK_END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(THINK_END):], "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held at the end: the rest of an unclosed think block is reasoning."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.kind == "deepseek_r1"):
            return rest, ""
        return "", rest


def split_reasoning(kind: str, text: str) -> tuple[str, str]:
    """The whole output's (reasoning, content)."""
    parser = ReasoningParser(kind)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.flush()
    return reasoning + tail_reasoning, content + tail_content
