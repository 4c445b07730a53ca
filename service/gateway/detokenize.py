"""Token ids to text while they stream in: whole characters only, and stop strings cut out.

`IncrementalDetokenizer` decodes a window of recent tokens twice (without and with the new
ones) and hands out the difference only when the text does not end in U+FFFD: a
multi-byte character split across tokens (byte-level BPE) comes out once, whole, when its
last byte arrives. The offsets only move at such clean ends, so the pieces always add up
to the decode of all the tokens.

`StopStrings` holds back the last `len(longest stop) - 1` characters, so that text handed
out never contains, or ends inside, a stop string.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing list of token ids, handed out in pieces that add up to the whole."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        """`decode`: token ids to text (special tokens skipped, as in the final answer)."""
        self._decode = decode
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # tokens whose text has been handed out

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; the text now complete ("" while a character is unfinished)."""
        self._token_ids.extend(token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is left, unfinished characters as U+FFFD (as a full decode)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]


class StopStrings:
    """Ends text at the first stop string; text it hands out never includes one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Take more text; what can be handed out now (nothing after a match)."""
        if self.matched is not None:
            return ""
        self._pending += text
        # Text handed out earlier was checked with `_hold` characters after it, so a match
        # can only start in the pending text.
        found = [(self._pending.find(s), s) for s in self._stop]
        found = [(index, s) for index, s in found if index >= 0]
        if found:
            index, self.matched = min(found)
            out, self._pending = self._pending[:index], ""
            return out
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end without a match: the text held back."""
        out, self._pending = self._pending, ""
        return out


class TextAssembler:
    """Tokens in, text out: detokenization then stop strings, one token at a time.

    It also knows which tokens the text handed out so far covers (`covered`), so that
    logprobs go with exactly the text a client reads: a token whose text is held back
    waits for it, and one past a stop string is never handed out."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stop = StopStrings(stop)
        self.num_tokens = 0  # tokens taken, up to and including the one that matched a stop
        # Per token taken: the length of the detokenized text once it is in (stop strings
        # not applied); a token inside an unfinished character ends where the one before.
        self._text_ends: list[int] = []
        self._num_chars_out = 0  # text handed out

    @property
    def stopped(self) -> bool:
        """A stop string matched: take no more tokens."""
        return self._stop.matched is not None

    def add(self, token_ids: Sequence[int]) -> str:
        out = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            piece = self._detokenizer.add([token_id])
            self._text_ends.append((self._text_ends[-1] if self._text_ends else 0) + len(piece))
            out.append(self._stop.push(piece))
        return self._out("".join(out))

    def finish(self) -> str:
        """At the end of the sequence: the rest of the text."""
        if self.stopped:
            return ""
        piece = self._detokenizer.flush()
        if self._text_ends:  # unfinished characters: the last token's text
            self._text_ends[-1] += len(piece)
        text = self._stop.push(piece)
        return self._out(text if self.stopped else text + self._stop.flush())

    def covered(self) -> tuple[int, int | None]:
        """The tokens the text handed out so far covers, from the first: how many, and
        how many characters of the last one's text are in it (None: all of it). A token
        is covered once all its text is out; after a stop string, the token the text ends
        inside is covered too, cut there, and none after it."""
        num = bisect_right(self._text_ends, self._num_chars_out)
        if not self.stopped or num == len(self._text_ends):
            return num, None
        start = self._text_ends[num - 1] if num else 0
        if start < self._num_chars_out:
            return num + 1, self._num_chars_out - start
        return num, None

    def _out(self, text: str) -> str:
        self._num_chars_out += len(text)
        return text
