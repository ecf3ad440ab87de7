"""`python -m tierzero.cli`: the `tierzero` command."""

import sys

from tierzero.cli.main import main

sys.exit(main())
