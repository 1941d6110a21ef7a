"""Resolve `--drafter dspark|dflash|eagle3|mtp|ngram|suffix|auto|NAME+suffix|DEEP+ONE|PATH` to a drafter.

A name picks the checkpoint shipped for the model (`assets/<model>/drafters/<kind>/`);
`ngram` and `suffix` need no weights; `auto` (= `dspark+suffix`) and `NAME+suffix` route each
request per step between the neural drafter NAME and the suffix drafter (`drafters/route.py`); `DEEP+ONE`
(`dspark+mtp`) proposes one position with the drafter ONE and more with DEEP (`drafters/pair.py`);
a path is a directory with `config.json` (+ `model.safetensors`): dspark's own format or a
published one (DeepSpec, speculators, DFlash, EAGLE-3), detected by `dspark/drafters/formats/`.
`new_drafter` builds an untrained one sized for a target (training, tests).
"""

from __future__ import annotations

from pathlib import Path

from dspark.config import ModelConfig
from dspark.drafters.base import KINDS, Drafter, DrafterConfig
from dspark.drafters.neural import NeuralDrafter

GAMMA = {"dspark": 7, "dflash": 7, "eagle3": 7, "mtp": 1, "ngram": 7, "suffix": 7}
WEIGHT_FREE = ("ngram", "suffix")


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """Tap layers spread over depth, never the last (6 layers: 0, 2, 4; 28 layers: 0, 9, 18)."""
    if num_layers < 2:
        return (0,)
    step = max(1, -(-(num_layers - 1) // count))  # ceil: the taps reach up the stack
    return tuple(range(0, num_layers - 1, step))[:count]


def drafter_class(kind: str, split_entry: bool = False):
    if kind in ("dspark", "dflash"):
        from dspark.drafters.block import BlockDrafter

        return BlockDrafter
    if kind == "eagle3" and split_entry:
        from dspark.drafters.eagle import Eagle3Drafter

        return Eagle3Drafter
    if kind in ("eagle3", "mtp"):
        from dspark.drafters.shifted import ShiftedDrafter

        return ShiftedDrafter
    if kind == "suffix":
        from dspark.drafters.suffix import SuffixDrafter

        return SuffixDrafter
    from dspark.drafters.ngram import NgramDrafter

    return NgramDrafter


def routed_parts(name: str) -> str | None:
    """The neural drafter a routed name pairs with the suffix drafter: 'auto' -> 'dspark',
    'dspark+suffix' (or 'suffix+dspark', a path in place of dspark) -> 'dspark'; None otherwise."""
    if name == "auto":
        return "dspark"
    parts = name.split("+")
    if len(parts) == 2 and "suffix" in parts and parts[0] != parts[1]:
        return parts[1] if parts[0] == "suffix" else parts[0]
    return None


def paired_parts(name: str) -> tuple[str, str] | None:
    """The two neural drafters of a pair, 'dspark+mtp' -> ('dspark', 'mtp'): the first proposes two or more
    positions, the second one (`drafters/pair.py`); None for anything else (a routed name pairs with suffix)."""
    parts = name.split("+")
    if len(parts) != 2 or parts[0] == parts[1] or routed_parts(name) is not None or Path(name).expanduser().is_dir():
        return None
    if any(p in WEIGHT_FREE or p == "auto" for p in parts):
        raise ValueError(f"drafter {name!r}: a pair joins two drafters with weights (a copy drafter routes: NAME+suffix)")
    return parts[0], parts[1]


def new_config(kind: str, target: ModelConfig, mask_token_id: int = 0, **overrides) -> DrafterConfig:
    """The config of an untrained `kind` drafter for `target` (`docs/architecture.md`, Drafter defaults)."""
    base = dict(
        kind=kind, gamma=GAMMA[kind], hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        vocab_size=target.vocab_size, mask_token_id=mask_token_id, taps=default_taps(target.num_hidden_layers),
        num_layers=2, head="markov", confidence=True,
    )
    if kind == "dflash":
        base.update(head="none", confidence=False)
    elif kind == "eagle3":
        base.update(num_layers=1, head="none", confidence=False)
    elif kind == "mtp":
        base.update(num_layers=1, head="none", confidence=False, taps=(target.num_hidden_layers - 1,))
    elif kind in WEIGHT_FREE:
        base.update(num_layers=0, head="none", confidence=False, taps=())
    base.update(overrides)
    return DrafterConfig(**base)


def new_drafter(config: DrafterConfig) -> Drafter:
    return drafter_class(config.kind, config.split_entry)(config)


def load_drafter(name: str, model_dir: Path | None = None, target: ModelConfig | None = None,
                 mask_token_id: int = 0) -> Drafter:
    """A shipped name (for the model at model_dir), `ngram`, `suffix`, a routed pair (NAME+suffix), a pair of neural
    drafters (DEEP+ONE), or a checkpoint directory."""
    if name in WEIGHT_FREE:
        if target is None:
            raise ValueError(f"the {name} drafter needs the target's config")
        return new_drafter(new_config(name, target, mask_token_id))
    neural = routed_parts(name)
    if neural is not None:
        from dspark.drafters.route import RoutedDrafter

        inner = load_drafter(neural, model_dir, target, mask_token_id)
        copy = load_drafter("suffix", model_dir, target, mask_token_id)
        copy.config = copy.config.replace(gamma=inner.gamma)
        return RoutedDrafter(inner, copy)  # type: ignore[arg-type]
    pair = paired_parts(name)
    if pair is not None:
        from dspark.drafters.pair import PairedDrafter

        deep, shallow = (load_drafter(p, model_dir, target, mask_token_id) for p in pair)
        return PairedDrafter(deep, shallow)  # type: ignore[arg-type]
    path = Path(name).expanduser()
    if name in KINDS:
        shipped = model_dir.parent / "drafters" / name if model_dir is not None else None
        if shipped is None or not (shipped / "config.json").is_file():
            raise FileNotFoundError(f"no shipped {name!r} drafter for this model in this install (a wheel carries "
                                    "the default model's dspark drafter only); pass a drafter directory")
        path = shipped
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter {name!r}: not a known kind ({', '.join(KINDS)}) nor a directory with config.json")
    from dspark.drafters import formats

    published = formats.load(path, target)
    if published is not None:
        return published
    config = DrafterConfig.from_json((path / "config.json").read_text())
    drafter = new_drafter(config)
    weights = path / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        drafter.load_state_dict(load_file(str(weights)))  # type: ignore[attr-defined]
    return drafter


def load_one(name: str, model_dir: Path | None = None, target: ModelConfig | None = None) -> NeuralDrafter:
    """`load_drafter` for the tools that read or write one drafter's weights (export, evaluation, a further training
    stage): a pair or a routed name joins two drafters and n-gram and suffix have none, so each is refused."""
    drafter = load_drafter(name, model_dir, target)
    if not isinstance(drafter, NeuralDrafter):
        raise ValueError(f"{name!r} is not one drafter with weights (a pair or a routed name joins two drafters; n-gram "
                         "and suffix have none): name a drafter directory")
    return drafter
