"""Train SpecDec++'s acceptance head on traced draft hidden states and pick its stopping threshold h.

The command-line front end of `mcsd.train.specdecpp`; `--help` lists the options.
"""

from mcsd.train.specdecpp import main

if __name__ == "__main__":
    raise SystemExit(main())
