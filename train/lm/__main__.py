"""python -m train.lm: flags only; the work is in train.lm's library modules."""

import sys

from train.lm.cli import main

sys.exit(main())
