"""Chains, path labels and a chain simulation shared by the length-policy trainers.

The code is `mcsd.train.length_data`; tools/train_disco.py and tools/train_specdecpp.py run it.
"""

from mcsd.train.length_data import main

if __name__ == "__main__":
    raise SystemExit(main())
