"""`python -m tierzero.cli`: the `tierzero` command."""

import sys

from tierzero.cli.launch import run

sys.exit(run())
