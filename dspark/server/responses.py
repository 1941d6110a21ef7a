"""OpenAI response and stream-chunk bodies, logprobs in OpenAI's shapes, streamed text.

Pure functions of what the engine produced: no I/O, no engine calls. `TextStream` turns the
text pieces the engine's detokenizer produced (`models/detokenize.py`: nothing here decodes)
into deltas whose concatenation is exactly the non-streamed text: when stop strings are set
it holds back the last (longest stop - 1) characters, since those might still become the
start of a stop string that the engine will cut off.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dspark.models.tokenizer import TextTokenizer


class TextStream:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.held = ""  # received, not sent yet (at most holdback characters between pushes)
        self.sent = 0  # characters sent

    def push(self, piece: str) -> str:
        """New text of an unfinished request -> the text that is now safe to send (may be empty)."""
        text = self.held + piece
        cut = max(0, len(text) - self.holdback)
        self.held = text[cut:]
        self.sent += cut
        return text[:cut]

    def finish(self, final_text: str) -> str:
        """The engine's final text (stop string removed) -> the rest of it. What was sent never
        reaches into a stop string: a stop string would have finished the request as soon as
        it was whole, so it begins within the last holdback characters of an earlier push."""
        rest = final_text[self.sent :]
        self.sent, self.held = len(final_text), ""
        return rest


def token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: TextTokenizer, entries: list[dict], text_offset: int) -> dict[str, list]:
    """Engine logprob entries -> the legacy completions `logprobs` object."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        tok = token_text(tokenizer, e["token_id"])
        out["tokens"].append(tok)
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({token_text(tokenizer, i): lp for i, lp in e.get("top", [])})
        out["text_offset"].append(text_offset)
        text_offset += len(tok)
    return out


def chat_logprobs(tokenizer: TextTokenizer, entries: list[dict]) -> dict[str, list]:
    """Engine logprob entries -> the chat `logprobs` object ({"content": [...]})."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        tok = token_text(tokenizer, token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    content = [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e.get("top", [])]}
               for e in entries]
    return {"content": content}


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage plus the request's speculative counters (0 under plain decoding)."""
    prompt, completion = stats.get("prompt_tokens", 0), stats.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            **{k: stats.get(k, 0) for k in ("draft_tokens", "verified_tokens", "accepted_tokens", "tau")}}


class Shaper:
    """Builds the bodies of one response: `chat` picks chat.completion vs text_completion."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: TextTokenizer, logprobs: bool) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.tokenizer, self.want_logprobs = tokenizer, logprobs
        self.created = int(time.time())
        self.offset = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[dict]) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, entries)
        out = completion_logprobs(self.tokenizer, entries, self.offset)
        self.offset = out["text_offset"][-1] + len(out["tokens"][-1]) if entries else self.offset
        return out

    def full(self, text: str, finish_reason: str | None, entries: list[dict], stats: dict) -> dict:
        """The non-streamed response body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=self._logprobs(entries), finish_reason=finish_reason)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": usage(stats)}

    def chunk(self, text: str, entries: list[dict], finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed chunk; the first chat chunk also carries the assistant role."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=self._logprobs(entries) if entries else None, finish_reason=finish_reason)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice]}

    def usage_chunk(self, stats: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(stats)}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {...}` (or the literal `data: [DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
