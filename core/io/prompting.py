"""Turn a (document, instruction) pair into prompt ids, truncating or refusing a document that does not fit.

User text (document and question) is tokenised as plain text: a special-token string in it (`<|im_end|>`) becomes
ordinary tokens, so only the chat template's own markers are control tokens. A long text is counted only as far as
the context needs: past that, its count is estimated from a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ContextOverflowError, TriForceError

MAX_DOCUMENT_CHARS = 2_000_000  # every way a document arrives (paste, upload, file, API) is held to this
_DOCUMENT, _QUESTION = "\x00DOCUMENT\x00", "\x00QUESTION\x00"  # placeholders: user text never enters the template
PLAIN_TEMPLATE = "Document:\n{content}\n\nAnswer:"
TRUNCATION_MARKER = "\n[...]\n"
MIN_ROOM = 16  # fewest document tokens a prompt must leave room for
SCAN_CHARS_PER_TOKEN = 8  # a count past a limit first tokenises (limit + SCAN_MARGIN) times this many characters
SCAN_MARGIN = 64  # tokens beyond the limit a prefix must hold (a word cut at its end tokenises differently)


@dataclass
class Prompt:
    """Prompt ids and how the document fared (document_tokens: as given, estimated when it did not fit)."""

    ids: list[int]
    document_tokens: int
    dropped_tokens: int


@dataclass
class Fit:
    """How a document fits the room a prompt leaves it: the template's ids around the document and the question,
    the ids of the document's head and tail (each the whole document's when it fits), its token count (estimated
    from them unless `exact`), and the tokens left for it."""

    before: list[int]
    between: list[int]
    question: list[int]
    after: list[int]
    head: list[int]
    tail: list[int]
    document_tokens: int
    exact: bool
    room: int
    marker: list[int]

    @property
    def overflows(self) -> bool:
        return self.document_tokens > self.room

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt a run builds: the template, the question and the document as kept."""
        kept = self.room if self.overflows else self.document_tokens
        return len(self.before) + len(self.between) + len(self.question) + len(self.after) + kept

    @property
    def dropped(self) -> int:
        """Document tokens a truncating run drops (its middle, to make room for the head, the tail and a marker)."""
        return self.document_tokens - (self.room - len(self.marker)) if self.overflows else 0


def plain_ids(tokenizer, text: str) -> list[int]:
    """Ids of user text as plain text: special-token strings become ordinary tokens, never control tokens."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def check_text(what: str, text: str) -> None:
    """Refuse text over MAX_DOCUMENT_CHARS characters or holding a lone surrogate (it has no UTF-8 form)."""
    if len(text) > MAX_DOCUMENT_CHARS:
        raise TriForceError(f"the {what} has {len(text):,} characters; the limit is {MAX_DOCUMENT_CHARS:,}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TriForceError(f"the {what} contains an invalid character (lone surrogate U+{ord(text[e.start]):04X} "
                            f"at character {e.start:,}); remove it or paste the text again") from None


def _scan(tokenizer, text: str, limit: int, from_end: bool = False) -> tuple[list[int], int]:
    """Ids of the shortest prefix (suffix: from_end) of text, doubling in length, that holds over `limit` +
    SCAN_MARGIN tokens, or of the whole text; and that prefix's length in characters."""
    n = (limit + SCAN_MARGIN) * SCAN_CHARS_PER_TOKEN
    while True:
        n = min(n, len(text))
        ids = plain_ids(tokenizer, text[len(text) - n:] if from_end else text[:n])
        if n == len(text) or len(ids) > limit + SCAN_MARGIN:
            return ids, n
        n *= 2


def count_tokens(tokenizer, text: str, limit: int) -> tuple[list[int], list[int], int, bool]:
    """Ids of text's head and tail (both the whole text's when it has at most about `limit` tokens), its token count
    (past the limit, estimated from the head's and tail's characters per token) and whether that count is exact."""
    head, n = _scan(tokenizer, text, limit)
    if n == len(text):
        return head, head, len(head), True
    tail, m = _scan(tokenizer, text, limit, from_end=True)
    return head, tail, round((len(head) + len(tail)) * len(text) / (n + m)), False


def _template(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """Ids of the rendered prompt before the document, between it and the question, and after the question."""
    content = f"{_DOCUMENT}\n\n{_QUESTION}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        specials = False
    else:
        text, specials = PLAIN_TEMPLATE.format(content=content), True
    before, rest = text.split(_DOCUMENT)
    between, after = rest.split(_QUESTION)
    return (tokenizer(before, add_special_tokens=specials)["input_ids"],
            tokenizer(between, add_special_tokens=False)["input_ids"],
            tokenizer(after, add_special_tokens=False)["input_ids"])


def document_fit(tokenizer, document: str, instruction: str, context_length: int, max_new_tokens: int) -> Fit:
    """How `document` fits a prompt with this instruction and answer room: what a run keeps and drops. Text over
    the character limit or not encodable is refused."""
    check_text("document", document)
    check_text("question", instruction)
    before, between, after = _template(tokenizer)
    template = len(before) + len(between) + len(after)
    if context_length - max_new_tokens - template < MIN_ROOM:
        raise TriForceError(f"max_new_tokens={max_new_tokens} leaves no room for a document in the model's "
                            f"{context_length}-token context")
    question, _, question_tokens, exact = count_tokens(tokenizer, instruction.strip(), context_length)
    room = context_length - max_new_tokens - template - question_tokens
    if room < MIN_ROOM:
        raise TriForceError(f"the question is too long: {'' if exact else 'about '}{question_tokens:,} tokens, and "
                            f"at most {question_tokens + room - MIN_ROOM:,} fit the model's {context_length}-token "
                            f"context beside a document and {max_new_tokens} answer tokens; shorten it")
    head, tail, total, exact = count_tokens(tokenizer, document, room)
    return Fit(before, between, question, after, head, tail, total, exact, room,
               plain_ids(tokenizer, TRUNCATION_MARKER))


def ids_prompt(ids: list[int], vocab_size: int, context_length: int, max_new_tokens: int) -> Prompt:
    """A prompt of token ids used as they are (no chat template, no truncation); ids out of the vocabulary, or too
    many for the context beside the answer, are refused in one line."""
    if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise TriForceError(f"the prompt must be a non-empty list of token ids below {vocab_size}")
    if len(ids) + max_new_tokens > context_length:
        raise TriForceError(f"{len(ids)} prompt tokens and {max_new_tokens} new ones exceed the "
                            f"{context_length}-token context")
    return Prompt(list(ids), len(ids), 0)


def build_prompt(tokenizer, document: str, instruction: str, context_length: int, max_new_tokens: int,
                 overflow: str) -> Prompt:
    """Prompt ids; a document over the room left is refused or loses its middle (head and tail kept)."""
    if not document or not document.strip():
        raise TriForceError("the document is empty: paste, upload or pick a document first")
    fit = document_fit(tokenizer, document, instruction, context_length, max_new_tokens)
    doc = fit.head
    if fit.overflows:
        if overflow == "refuse":
            raise ContextOverflowError(
                f"the document has {'' if fit.exact else 'about '}{fit.document_tokens:,} tokens but only "
                f"{fit.room:,} fit (context {context_length}, {max_new_tokens} kept for the answer, "
                f"{context_length - max_new_tokens - fit.room} for the template and question); "
                "shorten it or allow truncation")
        keep = fit.room - len(fit.marker)
        head = keep // 2
        doc = fit.head[:head] + fit.marker + fit.tail[len(fit.tail) - (keep - head):]
    return Prompt(fit.before + doc + fit.between + fit.question + fit.after, fit.document_tokens, fit.dropped)
