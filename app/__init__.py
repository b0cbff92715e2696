"""Gradio UI for TriForce Studio: turns the engine's event stream into live views (no tensors here)."""
