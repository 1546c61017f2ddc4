"""`python tests/lost_outside_a_collective.py FLAGS`: train.lm, in which the first checkpoint
save has process 1 kill itself (kill -9) and process 0 wait without a collective for ten
minutes, as it would in a long compilation or data preparation. No collective fails there: the
test of this (tests/test_multiprocess.py) checks that process 0 still stops at once, naming
process 1, instead of aborting when JAX's heartbeats time out."""

import os
import runpy
import signal
import sys
import time

import jax

from train.core import checkpoint


def save(self, state, **kwargs):
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


checkpoint.Checkpoints.save = save
sys.argv = ["train.lm", *sys.argv[1:]]
runpy.run_module("train.lm", run_name="__main__")
