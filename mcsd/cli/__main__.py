"""`python -m mcsd.cli`: the same as `mcsd-generate`."""

from . import entry

if __name__ == "__main__":
    entry()
