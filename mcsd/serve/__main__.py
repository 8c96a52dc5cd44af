"""`python -m mcsd.serve`: the same as `mcsd-serve`."""

from .cli import entry

if __name__ == "__main__":
    entry()
