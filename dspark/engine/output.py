"""What the engine tells its callers: a step's `StepOutput`, a request's `RequestOutput`.

`LLMEngine.step()` returns one frozen `StepOutput`: what the scheduler chose, what the
forward cost, what was drafted, verified and accepted, and which requests gained tokens or
finished. A step whose forward raised raises `StepFailed` naming the requests it ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dspark.engine.request import Request
from dspark.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepOutput:
    """One engine step, told by the engine (empty `plan.scheduled`: nothing ran)."""

    plan: SchedulerOutput
    progressed: tuple[Request, ...] = ()  # emitted tokens or finished (finished ones left the engine)
    finished: tuple[Request, ...] = ()
    new_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per request id: the tokens it gained
    num_forward_tokens: int = 0  # tokens through the target's forward: prefill + sum(1 + l_r)
    drafter_ran: bool = False
    drafted: Mapping[str, int] = field(default_factory=dict)  # per request id: draft tokens proposed
    verified: Mapping[str, int] = field(default_factory=dict)  # l_r
    accepted: Mapping[str, int] = field(default_factory=dict)  # accepted draft tokens
    times: Mapping[str, float] = field(default_factory=dict)  # draft / schedule / verify / accept seconds
    gate: Mapping | None = None  # the never-slower gate's state after the step (`Gate.snapshot`; None: no gate)

    @property
    def ran(self) -> bool:
        """Whether any request was scheduled (False: the step stalled)."""
        return bool(self.plan.scheduled)

    @property
    def scheduled_ids(self) -> list[str]:
        return [s.request.request_id for s in self.plan.scheduled]


class StepFailed(RuntimeError):
    """The step's forward raised; `request_ids` are the requests it ran (the cause is chained)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.request_ids = request_ids


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict
    logprobs: list[dict] | None = None

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason, "stats": self.stats}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out
