"""Tokenizer: a thin wrapper over HF `tokenizers` reading a checkpoint directory.

Only `tokenizer.json` (the fast-tokenizer format) is supported; special-token
ids are gathered from generation_config.json, config.json and
tokenizer_config.json, because checkpoints disagree on where they put them
(Llama-3 Instruct lists <|eot_id|> only in generation_config.json).
The chat template is exposed as a string; rendering it is the server's job.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._tok = _HFTokenizer.from_file(os.path.join(self.path, "tokenizer.json"))
        tok_cfg = _read_json(os.path.join(self.path, "tokenizer_config.json"))
        gen_cfg = _read_json(os.path.join(self.path, "generation_config.json"))
        model_cfg = _read_json(os.path.join(self.path, "config.json"))

        eos: list[int] = []
        for ids in (
            _ids(gen_cfg.get("eos_token_id")),
            _ids(model_cfg.get("eos_token_id")),
            self._lookup([_token_content(tok_cfg.get("eos_token"))]),
        ):
            eos += [i for i in ids if i not in eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

        bos = self._lookup([_token_content(tok_cfg.get("bos_token"))])
        bos = bos or _ids(gen_cfg.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))
        self.bos_token_id: int | None = bos[0] if bos else None
        pad = self._lookup([_token_content(tok_cfg.get("pad_token"))])
        self.pad_token_id: int | None = pad[0] if pad else None

        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # a list of {"name", "template"}; "default" is the chat one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and os.path.isfile(os.path.join(self.path, "chat_template.jinja")):
            with open(os.path.join(self.path, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        self.chat_template: str | None = template
        # The special tokens' text, as chat templates refer to them.
        self.bos_token: str = (
            _token_content(tok_cfg.get("bos_token"))
            or (self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "")
            or ""
        )
        self.eos_token: str = (
            _token_content(tok_cfg.get("eos_token"))
            or (self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else "")
            or ""
        )

    def _lookup(self, tokens: Iterable[str | None]) -> list[int]:
        ids = [self._tok.token_to_id(t) for t in tokens if t]
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(
        self, context_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> Callable[[int], str | None]:
        """A streaming decoder after context_ids: step(id) returns the text that id completes,
        or None while it completes none (part of a character, a skipped special token). One call
        into `tokenizers` per token, where a window decode makes two."""
        stream = DecodeStream(ids=[int(i) for i in context_ids], skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tok)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer.json."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    return Tokenizer(path)


def read_chat_template(template: str) -> str:
    """A chat template given as a file holding one, or as the Jinja source itself (SGLang's
    and vLLM's --chat-template). Its syntax is checked where it is rendered (the server)."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(
        f"chat template {template!r} is neither a file nor a Jinja template (one holds {{{{ ... }}}} or {{% ... %}})"
    )
