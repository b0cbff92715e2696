"""The text of a PDF, read in a child process that can be abandoned. pypdf runs there within limits on pages,
characters, what a compressed stream may expand to (pypdf's own limits), memory (the child's address space) and time
(the child is killed past it), at the lowest CPU priority: a crafted PDF costs the server neither a request thread
nor its other visitors' speed. This module imports only the standard library (and pypdf in the child), so the child
starts in a fraction of a second."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # where `python -m app.pdf` finds this module
EXPANSION_WORDS = ("decompress", "decoding")  # pypdf's LimitReachedError of a stream that expands too far says so
PAGE_TREE_ENTRIES = 2  # page tree entries (pages and the nodes above them) read per page allowed
SPLIT = "split it or paste the part you need."


class PdfRefused(ValueError):
    """A PDF that cannot be read, or not within the limits; the message says why in one line."""


@dataclass(frozen=True)
class PdfLimits:
    """What reading one PDF may take: characters of text (the document limit), pages, seconds of wall time, bytes of
    memory, and bytes that one compressed stream may expand to."""

    chars: int
    pages: int = 1000
    seconds: float = 60.0
    memory_bytes: int = 1 << 30
    stream_bytes: int = 32 << 20


def read_pdf(data: bytes, limits: PdfLimits) -> str:
    """The text of a PDF's pages, separated by blank lines, read by a child process within `limits`; PdfRefused says
    why it cannot be had."""
    child = subprocess.Popen([sys.executable, "-m", "app.pdf", json.dumps(asdict(limits))], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = child.communicate(data, timeout=limits.seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise PdfRefused(f"The PDF took over {limits.seconds:g} s to read: {SPLIT}") from None
    try:
        answer = json.loads(out)
    except ValueError:  # killed by a limit (CPU time: SIGXCPU) or crashed before it could answer
        raise PdfRefused(f"Could not read this PDF: its reader ended without an answer (exit code "
                         f"{child.returncode}).") from None
    if "refused" in answer:
        raise PdfRefused(answer["refused"])
    return answer["text"]


def extract(data: bytes, limits: PdfLimits) -> str:
    """The text of a PDF within `limits` (pages and characters counted as the pages are read), in this process;
    PdfRefused says why not."""
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
            raise PdfRefused(f"The PDF has {pages:,} pages; at most {limits.pages:,} are read: {SPLIT}")
        texts, chars = [], 0
        for page in reader.pages:
            if text := (page.extract_text() or "").strip():
                texts.append(text)
                chars += len(text) + 2
                if chars > limits.chars + 2:
                    raise PdfRefused(f"The PDF has more than {limits.chars:,} characters of text; the limit is "
                                     f"{limits.chars:,}.")
    except LimitReachedError as err:
        if any(word in str(err) for word in EXPANSION_WORDS):
            raise PdfRefused(f"The PDF's compressed stream expands past the limit of {expand / 2**20:g} MiB.") \
                from None
        if "page tree entry" in str(err):
            raise PdfRefused(f"The PDF's page tree has over {entries:,} entries; at most {limits.pages:,} pages are "
                             f"read: {SPLIT}") from None
        raise PdfRefused(f"Could not read this PDF: {err}") from None
    except MemoryError:
        raise PdfRefused(f"The PDF needs more than {limits.memory_bytes / 2**20:g} MiB of memory to read.") from None
    return "\n\n".join(texts)


def first_line(err: Exception) -> str:
    """The first line of an exception's message, or its class name when it has none."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def child_main(limits: PdfLimits) -> None:
    """The child: limit its own memory and CPU time, take the lowest priority, read the PDF from stdin and answer one
    JSON object on stdout ({"text": ...} or {"refused": reason})."""
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    cpu = math.ceil(limits.seconds) + 1  # a backstop: the parent kills the child after `seconds` of wall time
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    os.nice(19)
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a warning per odd object costs time and goes nowhere
    try:
        answer = {"text": extract(sys.stdin.buffer.read(), limits)}
    except PdfRefused as err:
        answer = {"refused": str(err)}
    except Exception as err:  # a malformed PDF can fail anywhere in the reader
        answer = {"refused": f"Could not read this PDF: {first_line(err)}"}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    child_main(PdfLimits(**json.loads(sys.argv[1])))
