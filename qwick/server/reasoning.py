"""Qwen3's thinking (`<think>...</think>`) split from the answer, for OpenAI-style `reasoning_content`.

Qwen3's chat template may open the think block itself (thinking models end the prompt with `<think>\\n`),
so the output can start inside the reasoning with only `</think>` to come; other prompts leave the model
to write `<think>` first, or nothing at all (`enable_thinking: false` puts an empty, closed block in the
prompt). Where the output starts is known from the prompt (`prompt_think_state`), so the split is
decided the same way streamed or not:

- starting inside: everything up to the first `</think>` is reasoning, the rest is content;
- starting outside: only a `<think>` at the very start of the output (after whitespace) opens reasoning;
  a `<think>` anywhere else is content;
- reasoning never closed (the output stopped, e.g. at max_tokens) stays reasoning, with no content;
- whitespace around the reasoning and before the answer is formatting: reasoning is stripped, content
  loses its leading whitespace after `</think>`.

`ReasoningParser` takes text deltas and returns (reasoning delta, content delta); tags split across deltas
are held back, never leaked. `split_reasoning(text)` is the same parser fed everything at once.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
_WHITESPACE = " \t\r\n"


def prompt_think_state(prompt_tail: str) -> str | None:
    """How the prompt (the decoded text of its last tokens) leaves thinking: "open" when it ends by opening
    a think block, as Qwen3's thinking templates (and DeepSeek-R1's distills) do (`...assistant\n<think>\n`);
    "closed" when it ends with a closed one (Qwen3 with `enable_thinking: false`); None otherwise."""
    tail = prompt_tail.rstrip(_WHITESPACE)
    if tail.endswith(THINK_START):
        return "open"
    if tail.endswith(THINK_END):
        return "closed"
    return None


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


_BEFORE, _THINKING, _AFTER, _CONTENT = range(4)


class ReasoningParser:
    """One choice's text, split into reasoning and content as it arrives."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = _THINKING if starts_in_reasoning else _BEFORE
        self._buf = ""  # text not emitted yet: a possible tag, or whitespace that may turn out to be edges
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped until this
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; return the (reasoning, content) that can be shown now."""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The text ended: return what was held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            buf = self._buf
            if self._state == _BEFORE:
                head = buf.lstrip(_WHITESPACE)
                if head.startswith(THINK_START):
                    self._state, self._buf = _THINKING, head[len(THINK_START) :]
                    continue
                if not final and THINK_START.startswith(head):
                    break  # may still become <think>
                self._state = _CONTENT
            elif self._state == _THINKING:
                if not self._reasoning_started:
                    buf = self._buf = buf.lstrip(_WHITESPACE)
                    if not buf:
                        break
                    self._reasoning_started = True
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning.append(buf[:end].rstrip(_WHITESPACE))
                    self._state, self._buf = _AFTER, buf[end + len(THINK_END) :]
                    continue
                if final:
                    reasoning.append(buf.rstrip(_WHITESPACE))
                    self._buf = ""
                    break
                # Hold back a partial </think> and the whitespace before it (it may end the reasoning).
                hold = _partial_suffix(buf, THINK_END)
                head = buf[: len(buf) - hold]
                keep = len(head) - len(head.rstrip(_WHITESPACE)) + hold
                reasoning.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                break
            elif self._state == _AFTER:
                head = buf.lstrip(_WHITESPACE)
                self._buf = head
                if not head:
                    break
                self._state = _CONTENT
            else:
                content.append(buf)
                self._buf = ""
        r, c = "".join(reasoning), "".join(content)
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        return r, c


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output: what streaming it would accumulate to."""
    parser = ReasoningParser(starts_in_reasoning)
    parser.feed(text)
    parser.finish()
    return "".join(parser.reasoning) or None, "".join(parser.content)
