"""python -m train.bench: parses the flags and runs the benchmarks (see train.bench)."""
import sys

from train.bench.options import parse_options
from train.bench.run import run_and_report

argv = sys.argv[1:]
sys.exit(run_and_report(parse_options(argv),
                        command=" ".join(["python -m train.bench", *argv])))
