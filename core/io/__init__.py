"""What comes in: models (loading, presets, installing the offline ones), documents and prompts."""
