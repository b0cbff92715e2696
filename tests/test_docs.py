"""What the docs say about serving visitors and about defaults is what the code does: each claim is checked against
the constant it describes, so that changing one without the other fails here."""

from __future__ import annotations

from pathlib import Path

from app.callbacks import TRIFORCE_TAB_METHOD
from app.service import RUN_SECONDS, VISITOR_JOBS, WAITING_JOBS
from core import GenerationConfig
from core.config import SEATS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def words(name: str) -> str:
    """A page of docs/ with its line breaks and runs of spaces as single spaces."""
    return " ".join((DOCS / name).read_text(encoding="utf-8").split())


def test_the_docs_say_how_many_runs_decode_at_once_wait_and_belong_to_a_visitor_as_the_app_serves_them() -> None:
    using, space = words("using-it.md"), words("space.md")
    for page in (using, space):
        assert f"in one batch, up to {SEATS} at once" in page
        assert "One generation runs at a time" not in page and "One queue serves every visitor in turn" not in page
    assert f"at most {WAITING_JOBS} wait in all" in using
    assert VISITOR_JOBS == 1 and "may hold one job, running or waiting" in using
    assert f"`TRIFORCE_RUN_SECONDS` of generation (default {RUN_SECONDS:g})" in using


def test_the_docs_name_the_default_method_of_the_engine_and_of_the_apps_tab_as_the_code_sets_them() -> None:
    page = words("method-auto.md")
    assert GenerationConfig().method == "auto" and "Method auto (the default of the engine and the command line" in page
    assert f"the app's TriForce tab runs `{TRIFORCE_TAB_METHOD}` unless you pick auto there" in page
