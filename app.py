"""TriForce Studio: `python app.py [--host H] [--port P]` serves the Gradio app (default http://127.0.0.1:7860)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import NoReturn

PORT_VARIABLES = ("TRIFORCE_PORT", "GRADIO_SERVER_PORT")  # the first one set names the port when --port does not
DEFAULT_PORT = 7860


def port_number(text: str) -> int:
    """A TCP port from text: a whole number from 1 to 65535, else argparse's one-line error."""
    text = text.strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be a whole number from 1 to 65535, got {text[:40]!r}")
    return int(text)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (exit code 2), as the command line's are (core.cli.main)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Host and port from the command line, else TRIFORCE_HOST/GRADIO_SERVER_NAME and TRIFORCE_PORT/GRADIO_SERVER_PORT.
    A bad port, given or in either variable, is refused in one line (exit code 2): Gradio reads GRADIO_SERVER_PORT as
    it is imported, and a value it cannot read would end in its traceback."""
    parser = Parser(description=__doc__)
    parser.add_argument("--host", default=os.environ.get("TRIFORCE_HOST") or os.environ.get("GRADIO_SERVER_NAME")
                        or "127.0.0.1")
    parser.add_argument("--port", type=port_number, help=f"default: {' or '.join(PORT_VARIABLES)}, else {DEFAULT_PORT}")
    args = parser.parse_args(argv)
    ports = []
    for name in PORT_VARIABLES:
        if value := os.environ.get(name, "").strip():
            try:
                ports.append(port_number(value))
            except argparse.ArgumentTypeError as err:
                parser.error(f"{name}: {err}")
    args.port = args.port or next(iter(ports), DEFAULT_PORT)
    return args


def unusable(host: str, port: int) -> str | None:
    """Why the app cannot listen on host:port (the port in use, or the host no address of this machine), or None.
    Checked before the models load (a minute on a CPU), as Gradio checks it before it starts its server."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
            probe.bind(address)
    except OSError as err:
        reason = "in use" if err.errno == 98 else err.strerror or str(err)  # EADDRINUSE
        return f"cannot listen on {host}:{port} ({reason}); pick another with --port or TRIFORCE_PORT"
    return None


if __name__ == "__main__":
    ARGS = parse_args()  # before Gradio is imported (below)
    if problem := unusable(ARGS.host, ARGS.port):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)

from core.process import configure  # noqa: E402  (light: importing core loads nothing)

configure()  # OpenMP's wait policy, before torch loads (core/process.py says why)
try:  # ZeroGPU needs `spaces` imported before torch (imported below through the engine)
    import spaces  # noqa: F401
except ImportError:
    spaces = None

from app.inference import SWITCH_INTERVAL_S, ModelLoadError, preset_engine, warm_up  # noqa: E402
from app.layout import build_demo, launch_options  # noqa: E402
from app.presets import default_preset  # noqa: E402
from app.service import ServiceError, run_seconds  # noqa: E402
from core.io.loading import needs_conversion  # noqa: E402

sys.setswitchinterval(SWITCH_INTERVAL_S)  # the engine's thread gets the GIL back soon (app/inference.py says why)

demo = build_demo()


def main(args: argparse.Namespace) -> int:
    """Load the default preset's models, then serve until interrupted; a start-up problem is one line (exit code
    2)."""
    try:
        run_seconds()  # a bad TRIFORCE_RUN_SECONDS is refused now, not at the first run
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    preset = default_preset()
    converting = needs_conversion(preset.sources()[0])  # said only where it happens: later starts load in seconds
    print(f"Loading {preset.name}" + (" (converting its GGUF into a checkpoint, once: about a minute on a CPU)"
                                      if converting else "") + " ...", flush=True)
    started = time.monotonic()
    try:  # load the default models up front (on ZeroGPU this must happen at start-up, outside @spaces.GPU)
        preset_engine(preset)
        print(f"Loaded in {time.monotonic() - started:.0f} s", flush=True)
        warmed = warm_up(preset)
        if warmed is not None:
            print(f"GPU kernels compiled in {warmed:.0f} s (a first request would have waited for them)", flush=True)
        print(f"Serving at http://{args.host}:{args.port}", flush=True)
    except ModelLoadError as err:
        print(f"warning: {err}")
    try:
        demo.launch(server_name=args.host, server_port=args.port, **launch_options())
    except OSError as err:  # the port taken while the models loaded, or a host uvicorn cannot serve
        print(f"error: cannot serve on {args.host}:{args.port}: {str(err).splitlines()[0] if str(err) else err!r}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
