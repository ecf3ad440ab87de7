"""The `tierzero` command: every argparse command lives under this package, and nowhere else.

`tierzero.cli:main` is the console script's entry point; `python -m tierzero.cli` runs it too.
"""

from tierzero.cli.main import main

__all__ = ["main"]
