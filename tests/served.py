"""The app served on a free loopback port, for tests that talk to it as its visitors do (gradio_client, HTTP, a
browser)."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def served(**launch: Any) -> Iterator[str]:
    """The app built and launched with launch_options() (`launch` overriding them) until the block ends; its URL."""
    from app.inference import SWITCH_INTERVAL_S
    from app.layout import build_demo, launch_options

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as app.py sets it for the process serving the app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    demo = build_demo()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                **(launch_options() | launch))
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
