"""Model presets (target + draft pairs) and the environment variables that choose one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

EMBEDDED = "SmolLM2-135M-Instruct (embedded, CPU/offline)"
CUSTOM = "Custom (TRIFORCE_TARGET / TRIFORCE_DRAFT)"


PRESET_SETTINGS = ("budget", "repetition_penalty")  # the settings a preset may choose; the rest keep their defaults


@dataclass(frozen=True)
class Preset:
    """A target model, an optional draft model, and the settings that suit them where they differ from the
    engine's defaults (by name, among PRESET_SETTINGS)."""

    name: str
    target: str | None  # None: the engine's embedded default
    draft: str | None
    settings: tuple[tuple[str, Any], ...] = ()


PRESETS: tuple[Preset, ...] = (
    # A 135M model loops without a penalty ("the King of the King of ..."); budget 512 of its 8K context.
    Preset(EMBEDDED, None, None, (("budget", 512), ("repetition_penalty", 1.2))),
    Preset("Paper: Yarn-Llama-2-7b-128k + llama-68m", "NousResearch/Yarn-Llama-2-7b-128k", "JackFram/llama-68m"),
    Preset("LWM-Text-Chat-128K + llama-68m", "LargeWorldModel/LWM-Text-Chat-128K", "JackFram/llama-68m"),
    Preset("Llama-3.1-8B-Instruct + Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
           "meta-llama/Llama-3.2-1B-Instruct"),
    Preset("Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
)


def env_preset(environ: dict[str, str] | None = None) -> Preset | None:
    """The preset named by TRIFORCE_TARGET / TRIFORCE_DRAFT, or None when TRIFORCE_TARGET is unset."""
    env = os.environ if environ is None else environ
    target = env.get("TRIFORCE_TARGET", "").strip()
    if not target:
        return None
    draft = env.get("TRIFORCE_DRAFT", "").strip() or None
    for preset in PRESETS:
        if preset.target == target and preset.draft == draft:
            return preset
    return Preset(CUSTOM, target, draft)


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
