"""The prepared GPU run in one call: `pytest -m gpu`, the embedded pair's interleaved benchmark, a 16-round
sync profile, one JSON for benchmarks/results/ (the stages: benchmarks/gpu_run.py).

    python tools/gpu_check.py --out benchmarks/results/gpu-check.json      # on the GPU machine
    python tools/gpu_check.py --tiny --device cpu --dtype float32 --no-pytest   # a smoke run anywhere

Carry the embedded target there first: tools/gpu_carry.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gpu_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
