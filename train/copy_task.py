"""python -m train.copy_task: flags only; the work is in `train.translate.copy_task`."""

from train.translate.copy_task import main

if __name__ == "__main__":
    main()
