"""Reading documents: bundled samples (assets/docs/samples.json) and uploads (text, source code, data, HTML, PDF)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from app.reader import Limits, Refused, read
from app.refusals import quote
from core.config import TriForceError
from core.io import MAX_DOCUMENT_CHARS, read_capped

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "assets" / "docs"
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".tex", ".log")
CODE_SUFFIXES = (".py", ".pyi", ".ipynb", ".js", ".mjs", ".jsx", ".ts", ".tsx", ".c", ".h", ".cc", ".cpp", ".cxx",
                 ".hpp", ".hh", ".cs", ".rs", ".go", ".java", ".kt", ".scala", ".swift", ".rb", ".php", ".pl", ".lua",
                 ".r", ".jl", ".sh", ".bash", ".ps1", ".sql", ".css", ".scss", ".vue", ".cu", ".m")
DATA_SUFFIXES = (".json", ".jsonl", ".toml", ".yaml", ".yml", ".csv", ".tsv", ".ini", ".cfg", ".conf", ".xml")
HTML_SUFFIXES = (".html", ".htm")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + CODE_SUFFIXES + DATA_SUFFIXES + HTML_SUFFIXES + (".pdf",)  # all read as UTF-8


class DocumentError(ValueError):
    """An upload that cannot be used as a document; the message says why."""


@dataclass(frozen=True)
class Sample:
    """A bundled sample document and its suggested instructions."""

    title: str
    path: Path
    kind: str = ""
    instructions: tuple[str, ...] = field(default_factory=tuple)

    def read(self) -> str:
        """The sample's text."""
        return self.path.read_text(encoding="utf-8")


def load_samples(samples_dir: Path = SAMPLES_DIR) -> list[Sample]:
    """Samples listed in samples.json whose files exist; [] when the list is missing or unreadable."""
    try:
        raw = json.loads((samples_dir / "samples.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    entries = raw.get("samples", []) if isinstance(raw, dict) else raw
    samples = []
    for entry in entries:
        if not isinstance(entry, dict) or "file" not in entry:
            continue
        path = samples_dir / entry["file"]
        if path.is_file():
            samples.append(Sample(title=str(entry.get("title") or entry["file"]), path=path,
                                  kind=str(entry.get("kind", "")),
                                  instructions=tuple(str(i) for i in entry.get("instructions", []))))
    return samples


def decode_text(data: bytes) -> str:
    """UTF-8 text of `data`; binary or non-UTF-8 bytes raise DocumentError."""
    if b"\x00" in data[:8192]:
        raise DocumentError("This file looks binary (it contains NUL bytes), not text. "
                            "Upload a text, source-code, data, HTML or PDF file.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DocumentError(f"This file is not valid UTF-8 text (byte {err.start}). "
                            "Save it as UTF-8 and upload it again.") from None


def parsed_text(data: bytes, kind: str) -> str:
    """Text of a PDF (pages separated by blank lines) or of an HTML page, read by a child process within the reader's
    limits (app.reader: parsing either can cost far more than reading the file)."""
    try:
        return read(data, kind, Limits(chars=MAX_DOCUMENT_CHARS))
    except Refused as err:
        raise DocumentError(str(err)) from None


def read_document(path: str | Path) -> str:
    """Text of an uploaded file, or DocumentError saying why it cannot be used."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DocumentError(f"Unsupported file type {quote(suffix) if suffix else '(none)'}; "
                            f"use one of {', '.join(SUPPORTED_SUFFIXES)}.")
    try:
        data = read_capped(path, MAX_UPLOAD_BYTES, "The file")
    except TriForceError as err:
        raise DocumentError(str(err)) from None
    if suffix == ".pdf":
        text = parsed_text(data, "pdf")
    else:
        text = decode_text(data)  # refuses binary and non-UTF-8 files in this process: reading is cheap
        if suffix in HTML_SUFFIXES:
            text = parsed_text(data, "html")
    if not text.strip():
        raise DocumentError("The file contains no text (a scanned PDF needs OCR first).")
    if len(text) > MAX_DOCUMENT_CHARS:
        raise DocumentError(f"The document has {len(text):,} characters; the limit is {MAX_DOCUMENT_CHARS:,}.")
    return text
