"""`dspark train walk`: where a greedy run's rounds start along each training answer (walked anchors).

    dspark train walk --config configs/drafter-small-dspark-walked.toml \
        --drafter dspark/assets/dspark-small/drafters/dspark --data answers.jsonl --out walked.jsonl

Each answer is walked as `eval-drafter` walks the held-out ones (`eval_drafter.walk`): the drafter's block
at every response position, teacher-forced, accepted up to its first miss of the target's argmax, the next
round starting after the token that follows. Every row is written back with `walk`, the positions its rounds
start from; a config with `walked` > 0 draws that share of its anchors from them (`anchors.pick_anchors`).
Exact on greedy answers (`regen --temperature 0`), where each next token is the target's argmax.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.train.drafter import DrafterTrainConfig, load_frozen_target, read_rows
from dspark.train.eval_drafter import chain_of, last_of, load_against, rounds_along, starts_of


def write_walks(cfg: DrafterTrainConfig, drafter_dir: str, data: str, out: str) -> dict:
    """Walk every answer of `data` with the drafter in `drafter_dir`; write the rows with `walk` to `out`."""
    from tqdm import tqdm

    target, tok = load_frozen_target(cfg)
    drafter = load_against(drafter_dir, target, cfg)
    drafter.eval()
    rows, rounds, tokens = read_rows(data), 0, 0
    path = Path(out).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in tqdm(rows, desc="walk"):
            start = len(row["prompt_ids"])
            chain = chain_of(drafter, target, row, cfg, tok.pad_id, refining=False)["walk"]
            walked = rounds_along(chain, start, last_of(row, cfg), drafter.config.gamma)
            rounds, tokens = rounds + len(walked), tokens + sum(n + 1 for n, _ in walked)
            f.write(json.dumps({**row, "walk": starts_of(walked, start)}) + "\n")
    return {"rows": len(rows), "rounds": rounds, "walk_tau": round(tokens / max(1, rounds), 4), "out": str(path)}
