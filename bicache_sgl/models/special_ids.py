"""A checkpoint folder's special token ids (the mask token, the EOS ids), read as the published
generate code reads them, for every family (bidirectional and block-causal alike).

The published config.json of LLaDA-MoE, LLaDA2.x and SDAR names no mask token: SDAR's generate
takes ``tokenizer.mask_token``, the dllm pipelines of LLaDA-MoE / LLaDA2 the tokenizer's
``<|mask|>``, and the hard-coded ids in their generate() signatures (156895, ...) are those of
the published vocabulary only. So each id is taken from the first of these that names it:

1. config.json (``mask_token_id``, ``eos_token_id``);
2. generation_config.json (the same keys);
3. the tokenizer's named tokens: for the mask ``<|mask|>``, then the tokenizer's declared
   ``mask_token`` (tokenizer_config.json, then special_tokens_map.json); for EOS its declared
   ``eos_token``; a name counts when the folder's vocabulary files (tokenizer.json's added tokens
   and vocabulary, tokenizer_config.json's ``added_tokens_decoder``, vocab.json) give it an id;
4. the family's hard-coded default (its published generate's), last.

An id outside the model's vocabulary (the embedding rows) is refused, naming where it came from:
``<source>: mask_token_id <id> is outside the vocabulary (<V>)`` (one text for every family).
The tokenizer files are read as JSON (nothing is executed, no tokenizer object is built).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .spec import CheckpointError, id_list

MASK_TOKEN = "<|mask|>"  # the dllm pipelines' (and LLaDA-MoE's / LLaDA2's tokenizers') mask token

C = TypeVar("C")


@dataclass(frozen=True)
class SpecialIds:
    """The ids and where each came from (``config.json``, ``generation_config.json``, a tokenizer
    file and token, or the family's default)."""

    mask: int
    mask_source: str
    eos: tuple[int, ...]
    eos_source: str


def _json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when absent. A file that is there but not a JSON object is
    a CheckpointError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object")
    return data


def _id_list(v: Any, where: str, key: str) -> tuple[int, ...]:
    """A token id or a non-empty list of them (integral floats accepted), else a CheckpointError."""
    out = id_list(v, where, key)
    if not out:
        raise CheckpointError(f"{where}: {key} must be a token id or a list of token ids, got {v!r}")
    return out


class _Tokenizer:
    """The folder's tokenizer files, read lazily: declared special tokens and the vocabulary."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._vocab: dict[str, int] | None = None

    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            v: dict[str, int] = {}
            vj = _json(self.folder / "vocab.json")
            v.update((k, i) for k, i in vj.items() if isinstance(i, int))
            tj = _json(self.folder / "tokenizer.json")
            model_vocab = (tj.get("model") or {}).get("vocab") if isinstance(tj.get("model"), dict) else None
            if isinstance(model_vocab, dict):
                v.update((k, i) for k, i in model_vocab.items() if isinstance(i, int))
            for t in tj.get("added_tokens") or []:
                if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
                    v[t["content"]] = t["id"]
            decoder = _json(self.folder / "tokenizer_config.json").get("added_tokens_decoder")
            if isinstance(decoder, dict):
                for i, t in decoder.items():
                    if isinstance(t, dict) and isinstance(t.get("content"), str) and str(i).isdigit():
                        v[t["content"]] = int(i)
            self._vocab = v
        return self._vocab

    def declared(self, key: str) -> tuple[str, str] | None:
        """(file name, token) of the tokenizer's declared ``key`` (``mask_token``, ``eos_token``)."""
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            v = _json(self.folder / name).get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) and v:
                return name, v
        return None

    def named(self, token: str) -> int | None:
        return self.vocab().get(token)


def read_special_ids(folder: str | Path, config: Mapping[str, Any], family: str, default_mask: int | None,
                     default_eos: tuple[int, ...]) -> SpecialIds:
    """The mask and EOS ids of ``folder`` (module docstring's order); ``config``: its config.json
    dict; ``family``, ``default_mask`` / ``default_eos``: the family's name and hard-coded ids."""
    folder = Path(folder)
    gen = _json(folder / "generation_config.json")
    tok = _Tokenizer(folder)
    mask: tuple[int, str] | None = None
    for where, src in (("config.json", config), ("generation_config.json", gen)):
        v = src.get("mask_token_id")
        if v is not None:
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"{where}: mask_token_id must be a token id, got {v!r}")
            mask = (v, where)
            break
    if mask is None:
        i = tok.named(MASK_TOKEN)
        if i is not None:
            mask = (i, f"the tokenizer's {MASK_TOKEN}")
    if mask is None:
        d = tok.declared("mask_token")
        if d is not None and tok.named(d[1]) is not None:
            mask = (tok.named(d[1]), f"{d[0]}: mask_token {d[1]}")
    if mask is None:
        if default_mask is None:
            raise CheckpointError(f"config.json, generation_config.json and the tokenizer of {folder} name no mask "
                                  f"token, and the {family} family has no default one")
        mask = (default_mask, f"the {family} default (config.json, generation_config.json and the tokenizer name "
                              "no mask token)")
    eos: tuple[tuple[int, ...], str] | None = None
    for where, src in (("config.json", config), ("generation_config.json", gen)):
        if src.get("eos_token_id") is not None:
            eos = (_id_list(src["eos_token_id"], where, "eos_token_id"), where)
            break
    if eos is None:
        d = tok.declared("eos_token")
        if d is not None and tok.named(d[1]) is not None:
            eos = ((tok.named(d[1]),), f"{d[0]}: eos_token {d[1]}")
    if eos is None:
        eos = (tuple(default_eos), f"the {family} default (config.json, generation_config.json and the tokenizer "
                                   "name no EOS token)")
    return SpecialIds(mask[0], mask[1], eos[0], eos[1])


def check_in_vocab(ids: SpecialIds, vocab_size: int) -> None:
    """Refuse an id outside ``[0, vocab_size)``, naming where it came from."""
    if not 0 <= ids.mask < vocab_size:
        raise CheckpointError(f"{ids.mask_source}: mask_token_id {ids.mask} is outside the vocabulary ({vocab_size})")
    bad = [i for i in ids.eos if not 0 <= i < vocab_size]
    if bad:
        raise CheckpointError(f"{ids.eos_source}: eos_token_id {bad[0]} is outside the vocabulary ({vocab_size})")


def parse_with_special_ids(folder: str | Path, config: Mapping[str, Any], parse: Callable[[Mapping[str, Any]], C],
                           family: str, default_mask: int | None, default_eos: tuple[int, ...]) -> C:
    """``parse(config.json dict)`` -> a config dataclass (ModelConfig or BlockModelConfig) whose
    ``mask_token_id`` / ``eos_token_ids`` are the folder's special ids (module docstring), checked
    against its vocabulary. The config is parsed with the mask id set to 0 (always inside the
    vocabulary) so that its own vocabulary check cannot refuse a default the folder overrides;
    then the ids read here replace it."""
    ids = read_special_ids(folder, config, family, default_mask, default_eos)
    cfg = parse({**config, "mask_token_id": 0})
    check_in_vocab(ids, cfg.vocab_size)  # type: ignore[attr-defined]
    return dataclasses.replace(cfg, mask_token_id=ids.mask, eos_token_ids=ids.eos)  # type: ignore[type-var]
