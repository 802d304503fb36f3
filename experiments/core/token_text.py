"""Text to token ids the way every probe needs them: no special tokens from the tokenizer, bos placed by us."""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens (ByT5 would append eos, Gemma prepend bos)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the tokenizer's bos in front, where it has one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos, *ids] if bos is not None else ids
