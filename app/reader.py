"""The text of a document whose parsing can cost more than reading it (a PDF, an HTML page), read in a child process
that can be abandoned, within limits on memory (the child's address space) and time (the child is killed past it), at
the lowest CPU priority: a crafted file costs the server neither a request thread nor its other visitors' speed. A
PDF is read by pypdf within limits on pages, characters and what a compressed stream may expand to (pypdf's own
limits); an HTML page by core.io.text's parser, pure Python that would hold the server's interpreter lock for as
long as it parses (eight megabytes of a million tags: 11 s, during which every other visitor's run crawled). This
module imports only the standard library (and pypdf or the HTML parser in the child), so the child starts in a
fraction of a second."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # where `python -m app.reader` finds this module
EXPANSION_WORDS = ("decompress", "decoding")  # pypdf's LimitReachedError of a stream that expands too far says so
PAGE_TREE_ENTRIES = 2  # page tree entries (pages and the nodes above them) read per page allowed
SPLIT = "split it or paste the part you need."
KINDS = {"pdf": "PDF", "html": "HTML page"}  # what the child reads, and how a refusal names it


class Refused(ValueError):
    """A document that cannot be read, or not within the limits; the message says why in one line."""


@dataclass(frozen=True)
class Limits:
    """What reading one document may take: characters of text (the document limit), seconds of wall time and bytes
    of memory; of a PDF also pages and bytes that one compressed stream may expand to."""

    chars: int
    pages: int = 1000
    seconds: float = 60.0
    memory_bytes: int = 1 << 30
    stream_bytes: int = 32 << 20


def read(data: bytes, kind: str, limits: Limits) -> str:
    """The text of a document of `kind` (one of KINDS), read by a child process within `limits`; Refused says why it
    cannot be had."""
    child = subprocess.Popen([sys.executable, "-m", "app.reader", kind, json.dumps(asdict(limits))], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = child.communicate(data, timeout=limits.seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise Refused(f"The {KINDS[kind]} took over {limits.seconds:g} s to read: {SPLIT}") from None
    try:
        answer = json.loads(out)
    except ValueError:  # killed by a limit (CPU time: SIGXCPU) or crashed before it could answer
        raise Refused(f"Could not read this {KINDS[kind]}: its reader ended without an answer (exit code "
                      f"{child.returncode}).") from None
    if "refused" in answer:
        raise Refused(answer["refused"])
    return answer["text"]


def extract_pdf(data: bytes, limits: Limits) -> str:
    """The text of a PDF within `limits` (pages and characters counted as the pages are read), in this process;
    Refused says why not."""
    from pypdf import PdfReader, overwrite_configuration
    from pypdf.errors import LimitReachedError

    expand, entries = limits.stream_bytes, PAGE_TREE_ENTRIES * limits.pages
    overwrite_configuration(zlib_maximum_output_length=expand, lzw_maximum_output_length=expand,
                            run_length_maximum_output_length=expand, jbig2_maximum_output_length=expand,
                            array_based_stream_maximum_output_length=expand, maximum_declared_stream_length=expand,
                            page_tree_maximum_entries=entries)
    try:
        reader = PdfReader(io.BytesIO(data))
        if (pages := len(reader.pages)) > limits.pages:
            raise Refused(f"The PDF has {pages:,} pages; at most {limits.pages:,} are read: {SPLIT}")
        texts, chars = [], 0
        for page in reader.pages:
            if text := (page.extract_text() or "").strip():
                texts.append(text)
                chars += len(text) + 2
                if chars > limits.chars + 2:
                    raise Refused(f"The PDF has more than {limits.chars:,} characters of text; the limit is "
                                  f"{limits.chars:,}.")
    except LimitReachedError as err:
        if any(word in str(err) for word in EXPANSION_WORDS):
            raise Refused(f"The PDF's compressed stream expands past the limit of {expand / 2**20:g} MiB.") \
                from None
        if "page tree entry" in str(err):
            raise Refused(f"The PDF's page tree has over {entries:,} entries; at most {limits.pages:,} pages are "
                          f"read: {SPLIT}") from None
        raise Refused(f"Could not read this PDF: {err}") from None
    except MemoryError:
        raise Refused(f"The PDF needs more than {limits.memory_bytes / 2**20:g} MiB of memory to read.") from None
    return "\n\n".join(texts)


def extract_html(data: bytes, limits: Limits) -> str:
    """The visible text of an HTML page within `limits` (characters), in this process; Refused says why not."""
    text = _html_to_text()(data.decode("utf-8-sig"))
    if len(text) > limits.chars:
        raise Refused(f"The HTML page has {len(text):,} characters of text; the limit is {limits.chars:,}.")
    return text


def _html_to_text() -> Callable[[str], str]:
    """core.io.text.html_to_text, imported when a page is read (a light module: importing core loads no torch)."""
    from core.io.text import html_to_text

    return html_to_text


def first_line(err: Exception) -> str:
    """The first line of an exception's message, or its class name when it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def child_main(kind: str, limits: Limits) -> None:
    """The child: limit its own memory and CPU time, take the lowest priority, read the document from stdin and
    answer one JSON object on stdout ({"text": ...} or {"refused": reason})."""
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    cpu = math.ceil(limits.seconds) + 1  # a backstop: the parent kills the child after `seconds` of wall time
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    os.nice(19)
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a warning per odd object costs time and goes nowhere
    try:
        answer = {"text": (extract_pdf if kind == "pdf" else extract_html)(sys.stdin.buffer.read(), limits)}
    except Refused as err:
        answer = {"refused": str(err)}
    except MemoryError:
        answer = {"refused": f"The {KINDS[kind]} needs more than {limits.memory_bytes / 2**20:g} MiB of memory to "
                             "read."}
    except Exception as err:  # a malformed file can fail anywhere in the reader
        answer = {"refused": f"Could not read this {KINDS[kind]}: {first_line(err)}"}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    child_main(sys.argv[1], Limits(**json.loads(sys.argv[2])))
