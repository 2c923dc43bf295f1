"""python -m pydatacopy.bench (torchrun --nproc_per_node=2 -m pydatacopy.bench [options])."""

import sys

from ._cli import main

sys.exit(main())
