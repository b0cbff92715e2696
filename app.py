"""TriForce Studio: `python app.py [--host H] [--port P]` serves the Gradio app (default http://127.0.0.1:7860)."""

from __future__ import annotations

try:  # ZeroGPU needs `spaces` imported before torch (imported below through the engine)
    import spaces  # noqa: F401
except ImportError:
    spaces = None

import argparse
import os
import time

from app.inference import ModelLoadError, preset_engine, warm_up
from app.layout import build_demo, launch_options
from app.presets import default_preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Host and port from the command line, else TRIFORCE_HOST/GRADIO_SERVER_NAME and
    TRIFORCE_PORT/GRADIO_SERVER_PORT."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default=os.environ.get("TRIFORCE_HOST") or os.environ.get("GRADIO_SERVER_NAME")
                        or "127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("TRIFORCE_PORT")
                                                        or os.environ.get("GRADIO_SERVER_PORT") or 7860))
    return parser.parse_args(argv)


demo = build_demo()

if __name__ == "__main__":
    args = parse_args()
    preset = default_preset()
    print(f"Loading {preset.name} (the first start converts the embedded GGUF once, about a minute on a CPU) ...",
          flush=True)
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
    demo.launch(server_name=args.host, server_port=args.port, **launch_options())
