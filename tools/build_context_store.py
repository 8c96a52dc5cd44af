"""Build a context datastore of earlier outputs for `mcsd-generate --context-store FILE`.

The command-line front end of `mcsd.train.context_store`; `--help` lists the options.
"""

from mcsd.train.context_store import main

if __name__ == "__main__":
    raise SystemExit(main())
