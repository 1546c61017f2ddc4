"""python -m train.bench: flags only; the work is in train.bench's library modules."""

import sys

from train.bench.run import main

sys.exit(main())
