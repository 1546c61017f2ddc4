"""python -m train.compare: flags only; the work is in `train.translate.compare`."""

import sys

from train.translate.compare import main

if __name__ == "__main__":
    sys.exit(main())
