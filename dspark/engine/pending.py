"""Committed tokens whose tapped features the drafter has not received yet."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.drafters.base import ContextRow
from dspark.engine.request import Request


class PendingContext:
    """Committed tokens whose features the drafter has not received yet. Handing them over
    lazily keeps undrafted steps (gate closed, hostile prompts) free of drafter work; each step
    adds one feature chunk per request (the token ids are the request's own, read at hand-over)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, list[int], list[torch.Tensor | None]]] = {}  # id -> (start, sizes, chunks)

    def add(self, seq_id: str, start: int, num_tokens: int, features: torch.Tensor | None) -> None:
        if num_tokens <= 0:
            return
        entry = self.rows.get(seq_id)
        if entry is None:
            self.rows[seq_id] = (start, [num_tokens], [features])
        else:
            entry[1].append(num_tokens)
            entry[2].append(features)

    def drop(self, seq_id: str) -> None:
        self.rows.pop(seq_id, None)

    def take(self, requests: Sequence[Request]) -> list[ContextRow]:
        """One merged row per request (features concatenated), removed from the queue."""
        out = []
        for req in requests:
            entry = self.rows.pop(req.request_id, None)
            if entry is None:
                continue
            start, sizes, chunks = entry
            feats = None if chunks[0] is None else torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            out.append(ContextRow(req.request_id, start, req.all_ids[start : start + sum(sizes)], feats))
        return out
