"""The round's parts as tensor functions: trees, sampling and its noise, acceptance, options, outputs."""
