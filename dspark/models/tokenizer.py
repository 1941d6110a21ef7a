"""The text side of a model directory: `tokenizer.json`, chat template, stop tokens.

Wraps a `tokenizers.Tokenizer` with what the engine needs: encode/decode, the chat
template of `tokenizer_config.json` (rendered with Jinja, as `transformers` does), and the
end-of-sequence ids from `generation_config.json` / `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tok: Tokenizer, config: dict, eos_token_ids: tuple[int, ...]) -> None:
        self.tok = tok
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.chat_template: str | None = config.get("chat_template")

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        eos: list[int] = []
        for source in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            value = source.get("eos_token_id")
            eos += value if isinstance(value, list) else ([value] if value is not None else [])
        name = config.get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        if name and tok.token_to_id(name) is not None:
            eos.append(tok.token_to_id(name))
        return cls(tok, config, tuple(dict.fromkeys(eos)))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def pad_id(self) -> int:
        """The id that pads batches (training rows, a peer's batched prompts): the end-of-text
        token where the vocabulary has one, else 0."""
        found = self.token_id("<|endoftext|>")
        return 0 if found is None else found

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        import jinja2  # local: only chat rendering needs it

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token="", eos_token=self.config.get("eos_token") or "",
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
