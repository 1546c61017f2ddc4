"""python -m train.translate: flags only; the work is in train.translate's library modules."""

import sys

from train.translate.cli import main

sys.exit(main())
