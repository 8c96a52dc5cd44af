"""Fit the acceptance model's logit shift per sampling temperature on decoding itself (its `sampled` table).

The command-line front end of `mcsd.train.sampled_acceptance`; `--help` lists the options.
"""

from mcsd.train.sampled_acceptance import main

if __name__ == "__main__":
    raise SystemExit(main())
