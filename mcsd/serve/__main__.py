"""`python -m mcsd.serve`: the same as `mcsd-serve`."""

from .cli import entry

entry()
