"""Prompt text to token ids: plain text through the tokenizer, chat messages through its chat template.

Used by ``specdec generate --chat`` and by the server, so both turn the same text into the same ids.
"""

from __future__ import annotations

__all__ = ["chat_ids", "text_ids"]


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def chat_ids(tokenizer, messages: list[dict], where: str = "messages") -> list[int]:
    """``messages`` (``[{"role": ..., "content": ...}]``) through the tokenizer's chat template, with the prompt for
    the assistant's turn. A tokenizer without a template, or a template that fails on these messages, is a
    ValueError starting with ``where``."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat template (give the server one with --chat-template "
                         "FILE, or use the completions endpoint)")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001  (a template is a program: its errors are the request's)
        raise ValueError(f"{where}: the chat template failed on these messages ({type(err).__name__}: {err})") \
            from None
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return list(ids)
