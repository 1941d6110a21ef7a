"""The public Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    from dspark import LLM, SamplingParams
    llm = LLM()  # the embedded dspark-small model, its dspark drafter and the dspark policy
    out = llm.generate(["Explain list comprehensions."], SamplingParams(temperature=0, max_tokens=64))
    print(out[0].text, out[0].finish_reason, out[0].stats)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dspark.config import EngineConfig
from dspark.engine.factory import build_engine
from dspark.engine.gate import GateConfig
from dspark.engine.output import RequestOutput
from dspark.sampling import SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, engine_config: EngineConfig | None = None,
                 drafter: str | None = None, policy: str | None = None, gamma: int | None = None,
                 profile: str = "auto", draft_vocab: int | None = None, gate: str | GateConfig | None = None,
                 **engine_kwargs) -> None:
        """drafter: dspark | dflash | eagle3 | mtp | ngram | suffix | auto | NAME+suffix | DEEP+ONE (dspark+mtp) | PATH;
        policy: none | static:K | threshold:T | dspark | dspark-async. Naming neither uses the model's default (the
        shipped dspark drafter and policy on the built-in models, plain decoding elsewhere).
        draft_vocab: draft from the N most frequent tokens (0: all; None: the drafter's own setting;
        `dspark draft-vocab`). gate: the never-slower gate's options, a GateConfig or 'enabled=0,cut=0'
        (None: the defaults)."""
        cfg = engine_config or EngineConfig(**engine_kwargs)
        if isinstance(gate, str):
            gate = GateConfig.parse(gate)
        self.engine = build_engine(model, drafter, policy, cfg, gamma, profile, draft_vocab=draft_vocab, gate=gate)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (batched together); all inputs are validated first."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        for prompt in prompts:
            self.engine.encode_prompt(prompt)  # raises before anything is queued
        requests = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        return self.engine.run_until_done(requests)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], params)[0]
