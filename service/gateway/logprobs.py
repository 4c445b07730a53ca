"""Log-probabilities in OpenAI's shapes, from the scheduler's per-token entries.

/v1/completions (`logprobs: k`): `{tokens, token_logprobs, top_logprobs, text_offset}`,
each `top_logprobs` entry a {token text: logprob} dict of the k most likely tokens plus the
chosen one (OpenAI: "up to logprobs + 1"), so `logprobs: 0` still gives every token's own
log-probability (tokens that read alike, such as byte pieces that each read U+FFFD, share
one key: the likeliest's value). With `echo`, the prompt's tokens come first; the first prompt token has
null logprob and top_logprobs (nothing predicts it), as OpenAI.
/v1/chat/completions (`logprobs: true, top_logprobs: k`): `{content: [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}] x k}]}`.
A token's text is the decode of that token alone (a piece of a multi-byte character is
U+FFFD, as in vLLM). Values are the model's raw distribution (log_softmax of its logits,
temperature, top-k and top-p not applied). A token the scheduler has no entry for (one
generated before a scheduler restart: logprobs are not persisted) gets logprob null.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from service.gateway.scheduler_link import TokenLogprob


class CompletionLogprobs:
    """Builds completions' `logprobs` objects; `text_offset` runs on across calls."""

    def __init__(self, decode: Callable[[list[int]], str], num_top: int) -> None:
        self._decode = decode
        self._num_top = num_top
        self._offset = 0

    def block(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None],
        last_token_chars: int | None = None,
    ) -> dict:
        """The object for these tokens (entries: one per token, None when unknown);
        `last_token_chars`: the last token's text is cut to that many characters (a stop
        string ended the answer inside it)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        last = len(token_ids) - 1
        for index, (token_id, entry) in enumerate(zip(token_ids, entries)):
            text = self._decode([token_id])
            if index == last and last_token_chars is not None:
                text = text[:last_token_chars]
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            top: dict[str, float] = {}
            for t, lp in zip(
                entry.top_token_ids[: self._num_top], entry.top_logprobs[: self._num_top]
            ):
                top.setdefault(self._decode([t]), lp)  # tokens of one text: the likeliest's
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
        return out


class ChatLogprobs:
    """Builds chat completions' `logprobs` objects."""

    def __init__(self, decode: Callable[[list[int]], str], num_top: int) -> None:
        self._decode = decode
        self._num_top = num_top

    def block(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None],
        last_token_chars: int | None = None,
    ) -> dict:
        """As CompletionLogprobs.block, in the chat shape."""
        content = []
        last = len(token_ids) - 1
        for index, (token_id, entry) in enumerate(zip(token_ids, entries)):
            cut = last_token_chars if index == last else None
            item = self._item(token_id, None if entry is None else entry.logprob, cut)
            item["top_logprobs"] = (
                []
                if entry is None
                else [
                    self._item(t, lp)
                    for t, lp in zip(
                        entry.top_token_ids[: self._num_top], entry.top_logprobs[: self._num_top]
                    )
                ]
            )
            content.append(item)
        return {"content": content}

    def _item(self, token_id: int, logprob: float | None, num_chars: int | None = None) -> dict:
        text = self._decode([token_id])
        if num_chars is not None:
            text = text[:num_chars]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge(blocks: Sequence[dict]) -> dict:
    """One object of several blocks' lists, end to end (a whole answer from its pieces)."""
    if not blocks:
        return {}
    return {key: [v for block in blocks for v in block[key]] for key in blocks[0]}
