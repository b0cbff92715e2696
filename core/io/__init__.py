"""What comes in: models (loading, presets, installing the offline ones), documents and prompts."""

from __future__ import annotations

from core.io.loading import default_device, load_tokenizer
from core.io.prompting import MAX_DOCUMENT_CHARS, build_prompt, document_fit, plain_ids
from core.io.presets import EMBEDDED, PRESETS, Preset
from core.io.samples import held_out_documents, sample_instructions
from core.io.inputs import gpu_memory_gib, gpu_only_note, note_gpu_only, read_capped
from core.io.text import html_to_text

__all__ = ["default_device", "load_tokenizer", "MAX_DOCUMENT_CHARS", "build_prompt", "document_fit", "plain_ids",
           "EMBEDDED", "PRESETS", "Preset", "held_out_documents", "sample_instructions", "gpu_memory_gib",
           "gpu_only_note", "note_gpu_only", "read_capped", "html_to_text"]
