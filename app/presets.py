"""The app's model presets: core.io.presets' table, the pair the environment names (TRIFORCE_TARGET / TRIFORCE_DRAFT),
and what the Settings panel marks as a preset's choice."""

from __future__ import annotations

import os
from typing import Any

from core.config import settings
from core.io import EMBEDDED, PRESETS, Preset

__all__ = ["CUSTOM", "EMBEDDED", "PRESETS", "PRESET_SETTINGS", "Preset", "all_presets", "default_preset",
           "env_preset", "panel_overrides", "preset_by_name"]

CUSTOM = "Custom (TRIFORCE_TARGET / TRIFORCE_DRAFT)"
# The settings some preset chooses, in declaration order: choosing another preset resets the rest to their defaults.
PRESET_SETTINGS = tuple(name for name in settings() if any(name in dict(p.settings) for p in PRESETS))


def env_preset(environ: dict[str, str] | None = None) -> Preset | None:
    """The preset named by TRIFORCE_TARGET (a preset id, or with TRIFORCE_DRAFT a pair of models), or None when
    TRIFORCE_TARGET is unset."""
    env = os.environ if environ is None else environ
    target = env.get("TRIFORCE_TARGET", "").strip()
    if not target:
        return None
    draft = env.get("TRIFORCE_DRAFT", "").strip() or None
    for preset in PRESETS:
        if (target == preset.id and draft is None) or preset.sources() == (target, draft):
            return preset
    return Preset("custom", CUSTOM, target, draft)


def all_presets(environ: dict[str, str] | None = None) -> list[Preset]:
    """The built-in presets, preceded by the environment's one when it is not built in."""
    custom = env_preset(environ)
    return ([custom] if custom and custom not in PRESETS else []) + list(PRESETS)


def default_preset(environ: dict[str, str] | None = None) -> Preset:
    """The environment's preset if set, else the embedded model."""
    return env_preset(environ) or PRESETS[0]


def preset_by_name(name: str, environ: dict[str, str] | None = None) -> Preset:
    """Look a preset up by its display name; unknown names raise ValueError."""
    for preset in all_presets(environ):
        if preset.name == name:
            return preset
    raise ValueError(f"Unknown model preset {name!r}; choose one from the list.")


def panel_overrides(preset: Preset) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings a preset chooses (values by name) and the notes in their help that say so."""
    chosen = dict(preset.settings)
    return chosen, {name: f"{value} is this preset's choice" for name, value in chosen.items()}
