"""Errors about models a user can fix, kept free of torch so the command line can catch them cheaply.

(`ConfigError`, for settings, lives with the settings in `mcsd.config`.)
"""


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be loaded; the message names the source and the cause."""


class TokenizerMismatchError(ModelLoadError):
    """Target and draft tokenizers differ; the message names the first difference."""
