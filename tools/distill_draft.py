"""Distil a small standalone draft model from its target (self-distillation).

The command-line front end of `mcsd.train.distill`; `--help` lists the options.
"""

from mcsd.train.distill import main

if __name__ == "__main__":
    raise SystemExit(main())
