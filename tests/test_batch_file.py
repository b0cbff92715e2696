"""`python -m core generate --batch FILE`: every line is checked before any model loads, and a bad one is refused in
one line naming it (`error: FILE line N: …`, exit code 2, no traceback); JSON Lines split at "\\n" only; the number
of requests and the characters read are bounded, a document named on many lines read once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.cli import batchfile
from core.cli.batchfile import MAX_BATCH_REQUESTS, read_batch
from core.cli.main import main
from core.config import MAX_SLOTS
from core.io.prompting import MAX_DOCUMENT_CHARS

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"document": "The dog sat on the log.", "prompt": "Where did the dog sit?"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder beside the batch files: a short document, a file that is no UTF-8, a FIFO and a subfolder."""
    root = tmp_path_factory.mktemp("batch")
    (root / "doc.txt").write_text("A short document.\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    os.mkfifo(root / "fifo.txt")
    (root / "sub").mkdir()
    return root


def write(folder: Path, *lines: str | dict, name: str = "requests.jsonl") -> Path:
    """A batch file of `lines` (a dict written as JSON, text as it is)."""
    path = folder / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def refused(path: Path, capfd, monkeypatch, *flags: str) -> str:
    """The one line `generate --batch path` prints, run in this process; a model load fails the test."""
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the batch file was checked")

    monkeypatch.setattr("core.cli.main.Engine.load", no_load)
    code = main(["generate", "--batch", str(path), *flags])
    out, err = capfd.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    return err.strip()


BAD_LINES = [
    ({"doc": 5, "prompt": "q"}, "\"doc\" must be a file name (text without NUL bytes), got 5"),
    ({"doc": None, "prompt": "q"}, "\"doc\" must be a file name (text without NUL bytes), got None"),
    ({"doc": ["doc.txt"], "prompt": "q"}, "\"doc\" must be a file name (text without NUL bytes), got ['doc.txt']"),
    ({"doc": "doc\x00.txt", "prompt": "q"}, "\"doc\" must be a file name (text without NUL bytes), got 'doc\\x00.txt'"),
    ({"doc": "missing.txt", "prompt": "q"}, "\"doc\" 'missing.txt': cannot open it (No such file or directory)"),
    ({"doc": "/dev/zero", "prompt": "q"}, "\"doc\" '/dev/zero' is not a regular file (a directory, device or pipe)"),
    ({"doc": "fifo.txt", "prompt": "q"}, "\"doc\" 'fifo.txt' is not a regular file (a directory, device or pipe)"),
    ({"doc": "sub", "prompt": "q"}, "\"doc\" 'sub' is not a regular file (a directory, device or pipe)"),
    ({"doc": "/proc/self/mem", "prompt": "q"}, "\"doc\" '/proc/self/mem': cannot read it (Input/output error)"),
    ({"doc": "latin1.txt", "prompt": "q"}, "\"doc\" 'latin1.txt' is not UTF-8 text (byte 0xe9 at offset 3)"),
    ({"document": "x" * (MAX_DOCUMENT_CHARS + 1), "prompt": "q"},
     "the document has 2,000,001 characters; the limit is 2,000,000"),
    ('{"document": "\\ud800", "prompt": "q"}', "the document contains an invalid character (lone surrogate U+D800"),
    ({"document": "x"}, "\"prompt\" must be text, got None"),
    ({"document": 7, "prompt": "q"}, "\"document\" must be text, got 7"),
    ({**GOOD, "temperature": -1}, "temperature must be between 0.0 and 2.0, got -1"),
    ({**GOOD, "max_new_tokens": "many"}, "max_new_tokens must be"),
    ({**GOOD, "budget": 100}, "budget (100) must be a multiple of chunk_size (8)"),
    ({**GOOD, "temprature": 1}, "unknown field 'temprature'"),
    ({**GOOD, "id": [1]}, "\"id\" must be text or a whole number, got [1]"),
    ({**GOOD, "id": "x" * 201}, "\"id\" must be at most 200 characters or 19 digits, got 'xxxx"),
    ('{"document": "x", "prompt": "q", "max_new_tokens": ' + "9" * 5000 + "}",
     "not JSON this reads (a number of thousands of digits)"),
    ('{"document": "x", "prompt": "q", "temperature": NaN}', "not JSON (NaN is not a JSON number)"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"document": "x", "prompt": ' + "[" * 900 + "]" * 900 + "}", "\"prompt\" must be text, got [[[["),
    ('{"document": "x"', "not JSON (Expecting ',' delimiter at column 17)"),
    ("[1, 2]", "not a JSON object (a list)"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[str(i) for i in range(len(BAD_LINES))])
def test_a_bad_line_is_refused_in_one_line_naming_it_before_a_model_loads(folder: Path, capfd, monkeypatch,
                                                                          line, message: str) -> None:
    path = write(folder, GOOD, "", line)
    assert refused(path, capfd, monkeypatch).startswith(f"error: requests.jsonl line 3: {message}")


def test_a_repeated_id_bad_slots_and_ids_without_json_are_refused_before_a_model_loads(
        folder: Path, capfd, monkeypatch) -> None:
    path = write(folder, {**GOOD, "id": "a"}, {**GOOD, "id": 7}, {**GOOD, "id": "a"})
    assert refused(path, capfd, monkeypatch) == ("error: requests.jsonl line 3: the id 'a' is already used by an "
                                                 "earlier line")
    path = write(folder, GOOD, {**GOOD, "id": 1})  # the first line's id is its number
    assert refused(path, capfd, monkeypatch) == ("error: requests.jsonl line 2: the id '1' is already used by an "
                                                 "earlier line")
    assert refused(write(folder, GOOD), capfd, monkeypatch, "--ids") == (
        "error: --ids adds each answer's ids to the lines of --batch FILE --json: give both")
    for slots in ("0", "-1", str(MAX_SLOTS + 1), str(10**30)):
        assert refused(write(folder, GOOD), capfd, monkeypatch, "--slots", slots) == (
            f"error: --slots {slots}: a batch decodes 1 to {MAX_SLOTS} requests at once")


def test_json_lines_split_at_newlines_only(folder: Path) -> None:
    """U+2028 and U+0085 inside a JSON string, written raw as json.dumps(ensure_ascii=False) does, are text."""
    text = "one\u2028two\u0085three\x0bfour"
    path = folder / "raw.jsonl"
    path.write_text(json.dumps({"id": "raw", "document": text, "prompt": "q"}, ensure_ascii=False) + "\n\n",
                    encoding="utf-8")
    requests = read_batch(path, None, {})
    assert [(r.key, r.document) for r in requests] == [("raw", text)]


def test_a_document_named_on_many_lines_is_read_once_and_the_requests_are_bounded(folder: Path, capfd,
                                                                                  monkeypatch) -> None:
    (folder / "big.txt").write_text("x" * MAX_DOCUMENT_CHARS, encoding="utf-8")
    lines = [{"id": i, "doc": "big.txt", "prompt": "q"} for i in range(MAX_BATCH_REQUESTS)]
    requests = read_batch(write(folder, *lines), None, {})
    assert len(requests) == MAX_BATCH_REQUESTS and all(r.document is requests[0].document for r in requests)
    path = write(folder, *lines, {"id": "one more", "doc": "doc.txt", "prompt": "q"})
    assert refused(path, capfd, monkeypatch) == (f"error: requests.jsonl line {MAX_BATCH_REQUESTS + 1}: more than "
                                                 f"{MAX_BATCH_REQUESTS:,} requests; split the file")


def test_the_characters_a_batch_reads_are_bounded_and_refused_naming_the_line(folder: Path, capfd,
                                                                              monkeypatch) -> None:
    monkeypatch.setattr(batchfile, "MAX_BATCH_CHARS", 2 * MAX_DOCUMENT_CHARS)
    for i in range(3):
        (folder / f"big{i}.txt").write_text(str(i) * MAX_DOCUMENT_CHARS, encoding="utf-8")
    path = write(folder, *[{"id": i, "doc": f"big{i}.txt", "prompt": "q"} for i in range(3)])
    assert refused(path, capfd, monkeypatch) == ("error: requests.jsonl line 2: the batch's documents and prompts "
                                                 "pass 4,000,000 characters in all; split the file")


def test_the_cli_refuses_deep_nesting_and_slots_in_one_line_without_loading_a_model(folder: Path) -> None:
    """Through the real command (a subprocess): no traceback, no loading line, exit code 2."""
    path = write(folder, GOOD, "[" * 100_000 + "]" * 100_000, name="deep.jsonl")
    for flags, message in (([], "error: deep.jsonl line 2: nested too deeply"),
                           (["--slots", str(10**30)], f"error: --slots {10**30}: a batch decodes 1 to {MAX_SLOTS} "
                                                      "requests at once")):
        r = subprocess.run([sys.executable, "-m", "core", "generate", "--batch", str(path), *flags],
                           capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", message + "\n")


def test_the_example_batch_file_in_the_repository_is_read_whole() -> None:
    requests = read_batch(ROOT / "examples" / "batch.jsonl", None, {})
    assert [r.key for r in requests] == ["garden-meeting", "garden-rabbits", "ferry-last", "inline"]
    assert requests[0].document is requests[1].document and "rabbits" in requests[0].document
