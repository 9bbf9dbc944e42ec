"""Token ids to text, one token at a time, for streaming: no half character, no text past a stop string.

:class:`IncrementalDetokenizer` turns committed ids into text deltas (the prefix / read offset method of
Hugging Face's text-generation-inference and vLLM): a character whose UTF-8 bytes are split across tokens is held
back until its last byte arrives, so no chunk carries a U+FFFD that the whole text does not, and one still incomplete
when the output ends (cut by ``max_tokens`` mid-character) is dropped, not sent as U+FFFD. :class:`StopMatcher`
holds back as many characters as a stop string could still need, so a stop string spanning tokens (or chunks) is
found and nothing after it is ever sent. :class:`TextStream` puts both together; the server feeds every request's
tokens through it, streamed or not, so the joined chunks of a stream equal the non-streamed text by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

#: prompt tokens decoded as context before the first new token (a leading space / merge depends on them)
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of the tokens pushed so far, handed out as deltas.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_ids: the prompt's token ids; its last :data:`CONTEXT_TOKENS` are context only (never emitted).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text, as vLLM does by default.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.sent = 0  # characters of the current window already handed out past its prefix text

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _delta(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        now = self._decode(self.ids[self.prefix_offset:])
        complete = not now.endswith(REPLACEMENT)
        shown = now if complete else now.rstrip(REPLACEMENT)  # an unfinished character waits; at the end, goes
        delta = shown[len(before) + self.sent:] if len(shown) > len(before) + self.sent else ""
        if complete or final:
            self.prefix_offset, self.read_offset, self.sent = self.read_offset, len(self.ids), 0
        else:
            self.sent += len(delta)
        return delta

    def push(self, token_id: int) -> str:
        """Append one token id; returns the text it completes ('' while a character is still incomplete; the text
        before such a character is not held back)."""
        self.ids.append(int(token_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """Text still held back at the end of the output, without an incomplete trailing character.

        An output cut inside a multi-byte character (``max_tokens`` reached after its first bytes, or a stop token
        right after them) decodes with a trailing U+FFFD; that character never completes, so its bytes are dropped
        rather than sent as U+FFFD. This is vLLM's choice: its incremental detokenizer returns no text while the
        decoded text ends in U+FFFD and has no final flush, so such a tail never reaches the output (Hugging Face's
        ``TextStreamer`` holds it back while streaming too, but its ``end()`` prints the rest, U+FFFD included).
        The cost, shared with vLLM: a U+FFFD the model meant (the character itself) as the very last text is
        dropped too; one followed by more text is kept."""
        return self._delta(final=True)


class StopMatcher:
    """Find the first stop string in text fed piece by piece; release only text that cannot start one.

    Args:
        stops: the stop strings (non-empty strings).
        include: keep the stop string itself in the output (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.include = [s for s in stops if s], include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; returns ``(text safe to emit, the stop string found or None)``. After a stop is found,
        the text after it is dropped and nothing more should be fed."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, None
        found = min(((i, s) for s in self.stops if (i := self.pending.find(s)) >= 0), default=None,
                    key=lambda t: t[0])
        if found is not None:
            i, s = found
            out = self.pending[:i + (len(s) if self.include else 0)]
            self.pending = ""
            return out, s
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        """The held-back text at the end of the output (it holds no whole stop string)."""
        out, self.pending = self.pending, ""
        return out


@dataclass
class Piece:
    """What one batch of tokens produced: ``text`` to emit, ``tokens`` consumed (counted in usage), and the stop
    string or stop token id that ended the output (``stop``), if any."""

    text: str
    tokens: int
    stop: str | int | None = None
    stopped: bool = False


class TextStream:
    """Committed token ids of one request in, text out: :class:`IncrementalDetokenizer` + :class:`StopMatcher`.

    Args:
        tokenizer: the target's tokenizer.
        prompt_ids: the prompt's token ids.
        stops: stop strings.
        stop_ids: ids that end the output (EOS and the request's stop token ids): such a token is counted in usage
            but its text is left out (vLLM's behaviour, unless ``include_stop``).
        include_stop: keep a stop string / stop token's text in the output.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stops=(), stop_ids=frozenset(), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.matcher = StopMatcher(list(stops), include_stop)
        self.stop_ids, self.include_stop = frozenset(stop_ids), include_stop
        self.tokens = 0
        self.done = False

    def feed(self, token_ids: list[int]) -> Piece:
        """Feed the tokens one step committed, in order. Stops at (and counts in ``tokens``) the token that completes
        a stop string or is a stop id; tokens after it are not consumed."""
        out, used = [], 0
        for t in token_ids:
            if self.done:
                break
            used += 1
            self.tokens += 1
            if t in self.stop_ids and not self.include_stop:
                end = self._end(self.detok.flush())
                return Piece("".join(out) + end.text, used, end.stop if end.stop is not None else int(t), True)
            text, stop = self.matcher.feed(self.detok.push(t))
            out.append(text)
            if stop is not None:
                self.done = True
                return Piece("".join(out), used, stop, True)
        return Piece("".join(out), used)

    def _end(self, text: str) -> Piece:
        self.done = True
        out, stop = self.matcher.feed(text)
        return Piece(out + ("" if stop is not None else self.matcher.flush()), 0, stop, stop is not None)

    def finish(self) -> Piece:
        """The text still held back when the output ended for another reason (length, a stop id kept in the text);
        a stop string completed by that last text still counts (``stopped``)."""
        if self.done:
            return Piece("", 0)
        return self._end(self.detok.flush())
