"""A `generate --batch` file read and checked whole before any model loads: one JSON object a line (JSON Lines: lines
end at "\\n" only), each a request with an "id", a "doc" file (relative to the batch file) or "document" text, a
"prompt" and any setting by name. Every refusal is one line naming the file and the line; the number of requests and
the characters read are bounded, and a document named on many lines is read once."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from core.batching import Request
from core.config import MAX_SLOTS, TriForceError, brief, settings
from core.io.inputs import read_capped
from core.io.presets import Preset, preset_config
from core.io.prompting import MAX_DOCUMENT_CHARS, check_text

MAX_BATCH_REQUESTS = 1_000  # a batch file is one run's work; more lines than this is a mistake or a flood
MAX_BATCH_CHARS = 8 * MAX_DOCUMENT_CHARS  # documents and prompts in all: a few full-size documents, held at once
MAX_BATCH_FILE_BYTES = 2 * MAX_BATCH_CHARS  # the file itself, read before its lines: room for JSON's quoting
MAX_ID_CHARS = 200  # an id names its request in every line printed about it: a name, not a document
FIELDS = ("id", "doc", "document", "prompt")  # a line's own fields; the others are settings


class Reader:
    """The state of one batch file's reading: the documents read so far (by file identity) and the characters
    counted against MAX_BATCH_CHARS."""

    def __init__(self, path: Path) -> None:
        self.path, self.chars = path, 0
        self.files: dict[tuple[int, int], str] = {}  # (device, inode) → text: a file named on many lines read once

    def count(self, chars: int) -> None:
        """Count `chars` more characters; refuse past MAX_BATCH_CHARS."""
        self.chars += chars
        if self.chars > MAX_BATCH_CHARS:
            raise over_total()

    def document(self, name: Any) -> str:
        """The text of the "doc" file `name` (relative to the batch file): a regular, readable UTF-8 file, read at
        most as far as the characters left allow (UTF-8 takes at most 4 bytes a character)."""
        if not isinstance(name, str) or not name or "\x00" in name:
            raise TriForceError(f"\"doc\" must be a file name (text without NUL bytes), got {brief(name)}")
        full = os.path.join(str(self.path.parent), name)  # never "-": a "doc" is a file, not stdin
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO for reading would wait for a writer
        except OSError as e:
            raise TriForceError(f"\"doc\" {brief(name)}: cannot open it ({e.strerror})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise TriForceError(f"\"doc\" {brief(name)} is not a regular file (a directory, device or pipe)")
        with open(fd, "rb") as f:
            key = (info.st_dev, info.st_ino)
            if key in self.files:
                return self.files[key]
            left = min(MAX_DOCUMENT_CHARS, MAX_BATCH_CHARS - self.chars)
            try:
                data = f.read(4 * left + 1)
            except OSError as e:  # e.g. /proc/self/mem: regular by its mode, unreadable from the start
                raise TriForceError(f"\"doc\" {brief(name)}: cannot read it ({e.strerror})") from None
        if len(data) > 4 * left:  # more bytes than `left` characters can take: more characters than that
            if left < MAX_DOCUMENT_CHARS:  # the batch's characters ran out before the document's
                raise over_total()
            raise TriForceError(f"\"doc\" {brief(name)} has more than {MAX_DOCUMENT_CHARS:,} characters, the "
                                "limit of a document")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TriForceError(f"\"doc\" {brief(name)} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                                f"{e.start:,})") from None
        if len(text) > MAX_DOCUMENT_CHARS:
            raise TriForceError(f"\"doc\" {brief(name)} has more than {MAX_DOCUMENT_CHARS:,} characters, the "
                                "limit of a document")
        self.count(len(text))
        self.files[key] = text = text.replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
        return text


def over_total() -> TriForceError:
    """The refusal of a batch whose documents and prompts pass MAX_BATCH_CHARS."""
    return TriForceError(f"the batch's documents and prompts pass {MAX_BATCH_CHARS:,} characters in all; split the "
                         "file")


def _no_constant(name: str) -> Any:
    """json.loads' hook for NaN and Infinity, which are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number")


def read_lines(path: Path) -> list[str]:
    """The lines of a batch file (split at "\\n" only), its bytes read up to MAX_BATCH_FILE_BYTES and decoded as
    UTF-8; a bad byte is refused naming its line."""
    data = read_capped(path, MAX_BATCH_FILE_BYTES, path.name)
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        number = data.count(b"\n", 0, e.start) + 1
        raise TriForceError(f"{path.name} line {number}: not UTF-8 text (byte {data[e.start]:#04x})") from None


def parse_line(line: str) -> dict:
    """One line's JSON object; anything else refused in one line (a huge number or deep nesting too)."""
    try:
        item = json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise TriForceError(f"not JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # an integer of thousands of digits (Python's int limit), NaN or Infinity
        raise TriForceError("not JSON this reads (a number of thousands of digits)" if "digits" in str(e) else
                            f"not JSON ({e})") from None
    except RecursionError:
        raise TriForceError("nested too deeply") from None
    if not isinstance(item, dict):
        raise TriForceError(f"not a JSON object (a {type(item).__name__})")
    return item


def request(item: dict, number: int, reader: Reader, preset: Preset | None, typed: dict) -> Request:
    """The request of one line's object, every field checked."""
    known = set(settings())
    if unknown := sorted(set(item) - known - set(FIELDS)):
        raise TriForceError(f"unknown field {brief(unknown[0])}")
    key = item.get("id", number)
    if isinstance(key, bool) or not isinstance(key, (str, int)) or isinstance(key, str) and not key.strip():
        raise TriForceError(f"\"id\" must be text or a whole number, got {brief(key)}")
    if isinstance(key, int) and not -2**63 <= key < 2**63 or isinstance(key, str) and len(key) > MAX_ID_CHARS:
        raise TriForceError(f"\"id\" must be at most {MAX_ID_CHARS} characters or 19 digits, got {brief(key)}")
    if ("doc" in item) == ("document" in item):
        raise TriForceError("give either \"doc\" (a file) or \"document\" (text)")
    prompt = item.get("prompt")
    if not isinstance(prompt, str):
        raise TriForceError(f"\"prompt\" must be text, got {brief(prompt)}")
    check_text("question", prompt)
    reader.count(len(prompt))
    if "doc" in item:
        document = reader.document(item["doc"])
    else:
        document = item["document"]
        if not isinstance(document, str):
            raise TriForceError(f"\"document\" must be text, got {brief(document)}")
        check_text("document", document)
        reader.count(len(document))
    try:
        config = preset_config(preset, **{**typed, **{k: v for k, v in item.items() if k in known}}).validate()
    except (TypeError, ValueError, OverflowError) as e:
        raise TriForceError(str(e)) from None
    return Request(str(key), document, prompt, config=config)


def read_batch(path: Path, preset: Preset | None, typed: dict) -> list[Request]:
    """Every request of a --batch file, checked before any model loads; the first bad line refused (TriForceError)
    as "FILE line N: …"."""
    try:
        preset_config(preset, **typed).validate()  # the flags alone: a bad flag is not any line's fault
    except TypeError as e:
        raise TriForceError(str(e)) from None
    reader, requests, seen = Reader(path), [], set()
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip(" \t\r"):  # JSON's whitespace only: U+2028 and the like are text
            continue
        try:
            if len(requests) == MAX_BATCH_REQUESTS:
                raise TriForceError(f"more than {MAX_BATCH_REQUESTS:,} requests; split the file")
            made = request(parse_line(line), number, reader, preset, typed)
            if made.key in seen:
                raise TriForceError(f"the id {brief(made.key)} is already used by an earlier line")
        except TriForceError as e:
            raise TriForceError(f"{path.name} line {number}: {e}") from None
        except RecursionError:  # a deeply nested value shown in a message
            raise TriForceError(f"{path.name} line {number}: nested too deeply") from None
        seen.add(made.key)
        requests.append(made)
    if not requests:
        raise TriForceError(f"{path.name}: no requests")
    return requests


def check_slots(slots: int) -> None:
    """Refuse a --slots outside 1..MAX_SLOTS before anything loads."""
    if not 1 <= slots <= MAX_SLOTS:
        raise TriForceError(f"--slots {brief(slots)}: a batch decodes 1 to {MAX_SLOTS} requests at once")
