"""`python -m hf_kvcodecs.cli`: the ``hf-kvcodecs`` console script."""

import sys

from . import run

sys.exit(run())
