"""`python -m mcsd.cli`: the same as `mcsd-generate`."""

from . import entry

entry()
