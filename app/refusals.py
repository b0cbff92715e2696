"""What a visitor is told when the app refuses something, and what the server log keeps of it.

A value the visitor typed is shown short and inert: Gradio renders a toast's text as HTML and a Markdown line as
Markdown (sanitised: scripts go, links and images stay), and a deep link (`/?deep_link=…`) replays one visitor's
values on another visitor's page, so a value shown as it came would put a live link or a tracking image there.
Each refusal is one line of log, never a traceback (gr.Error prints one unless told not to)."""

from __future__ import annotations

import logging
import re
from typing import Any

import gradio as gr

from core.config import brief

LOGGED_CHARS = 500  # of a refusal's message in the log
# Characters that HTML or Markdown read as markup, written as numeric character references: both render a reference
# as the character itself, never as markup (a Markdown link or image needs a literal "[", an autolink a literal ":" or
# "@", emphasis a literal "*" or "_"; an HTML tag a literal "<").
INERT = str.maketrans({c: f"&#{ord(c)};" for c in "&<>[]()*_`!#|~\\{}:@"})
BARE_WWW = re.compile(r"(www)\.", re.IGNORECASE)  # GFM links "www.host" without a scheme: that dot becomes a reference
log = logging.getLogger("triforce.refusals")


def cut(text: str, limit: int) -> str:
    """`text` up to `limit` characters, "…" in place of the rest."""
    return text if len(text) <= limit else text[:limit] + "…"


def inert(text: str) -> str:
    """`text` as HTML and Markdown both show it, character for character, with no markup read into it."""
    return BARE_WWW.sub(r"\1&#46;", text.translate(INERT))


def quote(value: Any) -> str:
    """A value a visitor gave, as a message shows it: cut short as the engine's refusals show it (core.config.brief),
    inert."""
    return inert(brief(value))


def quoted_in(message: str, *values: Any) -> str:
    """`message` (another module's, naming values cut short or as their repr) with each of `values` quoted instead."""
    for value in values:
        for shown in (repr(value), brief(value)):
            if shown in message and shown != quote(value):
                message = message.replace(shown, quote(value))
    return message


def refuse(message: str, title: str = "Error") -> gr.Error:
    """The gr.Error that refuses a request with `message` (its values already quoted), logged as one line."""
    log.warning("refused (%s): %s", title, cut(" ".join(message.split()), LOGGED_CHARS))
    return gr.Error(message, title=title, print_exception=False)
