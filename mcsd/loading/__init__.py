"""Where models and prompts come from: sources, presets, GGUF conversion, the cache folder, prompt sets."""
