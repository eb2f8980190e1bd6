"""A training script imported as a module: it exits at import, as `if not args: sys.exit(usage)` does."""

import sys

sys.exit("train.py is a script: run it as python train.py --config CONFIG")


def build():  # never reached
    pass
