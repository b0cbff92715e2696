"""Turn a (document, instruction) pair into prompt ids, truncating or refusing a document that does not fit."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ContextOverflowError, TriForceError

_MARK = "\x00DOCUMENT\x00"
PLAIN_TEMPLATE = "Document:\n{content}\n\nAnswer:"


@dataclass
class Prompt:
    """Prompt ids and how the document fared."""

    ids: list[int]
    document_tokens: int  # as given, before any truncation
    dropped_tokens: int


def _template_parts(tokenizer, instruction: str) -> tuple[list[int], list[int]]:
    """Ids before and after the document in the rendered prompt."""
    content = f"{_MARK}\n\n{instruction.strip()}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        specials = False
    else:
        text, specials = PLAIN_TEMPLATE.format(content=content), True
    before, after = text.split(_MARK)
    return (tokenizer(before, add_special_tokens=specials)["input_ids"],
            tokenizer(after, add_special_tokens=False)["input_ids"])


def build_prompt(tokenizer, document: str, instruction: str, context_length: int, max_new_tokens: int,
                 overflow: str) -> Prompt:
    """Prompt ids; a document over the room left is refused or loses its middle (head and tail kept)."""
    if not document or not document.strip():
        raise TriForceError("the document is empty: paste, upload or pick a document first")
    before, after = _template_parts(tokenizer, instruction)
    doc = tokenizer(document, add_special_tokens=False)["input_ids"]
    room = context_length - max_new_tokens - len(before) - len(after)
    if room < 16:
        raise TriForceError(f"max_new_tokens={max_new_tokens} leaves no room for a document in the model's "
                            f"{context_length}-token context")
    total, dropped = len(doc), 0
    if len(doc) > room:
        if overflow == "refuse":
            raise ContextOverflowError(
                f"the document has {len(doc)} tokens but only {room} fit (context {context_length}, "
                f"{max_new_tokens} kept for the answer, {len(before) + len(after)} for the template); "
                "shorten it or allow truncation")
        marker = tokenizer("\n[...]\n", add_special_tokens=False)["input_ids"]
        keep = room - len(marker)
        head = keep // 2
        dropped = len(doc) - keep
        doc = doc[:head] + marker + doc[len(doc) - (keep - head):]
    return Prompt(before + doc + after, total, dropped)
