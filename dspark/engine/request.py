"""A request's life inside the engine: tokens, KV progress, output text and stats.

`num_computed` counts the tokens whose K/V are in the target cache; the tokens after it
(the rest of the prompt, or the last sampled token, i.e. the anchor) are what the next
step feeds to the target. Preemption only resets `num_computed` to 0: the prompt and the
output so far are recomputed, nothing is lost.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from dspark.models.detokenize import Detokenizer
from dspark.sampling import SamplingParams

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Per-request counters; the speculative ones stay 0 under plain decoding."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0  # decode rounds that emitted tokens for this request
    draft_tokens: int = 0  # proposed by the drafter
    verified_tokens: int = 0  # sent to the target for verification (sum of l_r)
    accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position k
    verified_per_position: list[int] = field(default_factory=list)  # tried at k (verified, prefix accepted)
    preemptions: int = 0
    draft_tokens_by: dict[str, int] = field(default_factory=dict)  # draft tokens per proposing drafter
    accepted_tokens_by: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per proposing drafter
    step_seconds: dict[str, float] = field(default_factory=dict)  # draft / schedule / verify / accept

    @property
    def tau(self) -> float:
        """Mean tokens emitted per decode round, bonus/recovered included (1.0 for plain
        decoding). The first token comes from the prefill pass, so it is not a round."""
        return (self.completion_tokens - 1) / (self.rounds - 1) if self.rounds > 1 else 1.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.completion_tokens < 2:
            return None
        span = self.finish_time - self.first_token_time
        return (self.completion_tokens - 1) / span if span > 0 else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "rounds": self.rounds,
            "tau": round(self.tau, 4),
            "draft_tokens": self.draft_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "preemptions": self.preemptions,
            "draft_tokens_by": dict(self.draft_tokens_by),
            "accepted_tokens_by": dict(self.accepted_tokens_by),
            "accepted_per_position": list(self.accepted_per_position),
            "verified_per_position": list(self.verified_per_position),
            "step_seconds": {k: round(v, 6) for k, v in self.step_seconds.items()},
            "ttft_s": None if self.ttft is None else round(self.ttft, 6),
            "latency_s": None if self.finish_time is None else round(self.finish_time - self.arrival_time, 6),
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, device: torch.device | str,
                 generator: torch.Generator | None = None, detokenizer: Detokenizer | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.all_ids: list[int] = list(prompt_ids)  # prompt + output, grown in place (never rebuilt)
        self.detokenizer = detokenizer  # the output text, token by token (None: ids only)
        self.output_logprobs: list[dict] = []
        self.num_computed = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""  # the output text once finished, stop string removed
        self.arrival = next(_arrivals)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_model_len = max_model_len
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        # a seeded request draws from its own generator; any other from the one it is given
        # (the engine's), never from torch's global RNG, which belongs to the caller
        self.generator = generator
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    def append(self, token_id: int) -> None:
        """One emitted token: the output, the whole sequence and the text grow by it."""
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)
        if self.detokenizer is not None:
            self.detokenizer.push(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Known tokens not yet in the KV cache (prompt chunks, or the anchor)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True while the pending tokens include more than the newest sampled token."""
        return self.num_pending > 1 or not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens this request may still emit (max_tokens and context)."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_model_len - self.num_tokens)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, {len(self.output_ids)} out)"
