"""`dspark bench decode`: plain-decoding throughput of this engine against `transformers`
`generate()` on the same checkpoint, single stream and N concurrent requests, side by side.

Both decode greedily exactly `--max-tokens` tokens per prompt (EOS ignored) from the same
prompts; runs alternate (ours, theirs, ours, ...) and the best of `--repeats` is kept.

    dspark bench decode --max-tokens 128 --concurrency 1,16
"""

from __future__ import annotations

import time

import torch

from dspark import report
from dspark.bench.prompts import ONE_PER_DOMAIN, load_prompt_texts


def ours(engine, prompts: list[list[int]], max_tokens: int) -> float:
    from dspark.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done(reqs)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def theirs(hf, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                    do_sample=False, pad_token_id=pad_id)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def run(model: str | None, concurrency: list[int], max_tokens: int, repeats: int, out: str) -> dict:
    import transformers

    from dspark.config import EngineConfig
    from dspark.engine.factory import assemble
    from dspark.models.loader import load_model, model_label, resolve_model_path

    path = resolve_model_path(model)
    net, tok = load_model(path, "cpu", "float32")
    engine = assemble(net, tok, EngineConfig(device="cpu", max_num_seqs=max(concurrency)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = load_prompt_texts(list(ONE_PER_DOMAIN), per_dataset=max(concurrency))
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    encoded = [tok.encode(c)[-256:] for c in chat]
    pad = tok.pad_id
    rows = []
    ours(engine, encoded[:2], 8)  # warm-up both
    theirs(hf, encoded[:2], 8, pad)
    for c in concurrency:
        batch = encoded[:c]
        a, b = [], []
        for _ in range(repeats):
            a.append(ours(engine, batch, max_tokens))
            b.append(theirs(hf, batch, max_tokens, pad))
        rows.append({"concurrency": c, "dspark_tok_s": max(a), "transformers_tok_s": max(b), "ratio": max(a) / max(b)})
    md = "# Plain decoding: dspark engine vs transformers generate()\n\n" + report.table(
        ["concurrent requests", "dspark tok/s", "transformers tok/s", "dspark / transformers"],
        [[r["concurrency"], r["dspark_tok_s"], r["transformers_tok_s"], r["ratio"]] for r in rows],
    ) + f"\nModel: `{model_label(path)}`; greedy, {max_tokens} new tokens per request (EOS ignored), best of {repeats} alternating runs.\n"
    payload = {"benchmark": "decode", "model": str(path), "max_tokens": max_tokens, "rows": rows}
    report.write(out, "decode", payload, md)
    print(md)
    return payload
