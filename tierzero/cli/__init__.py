"""The `tierzero` command: every argparse command lives under this package, and nowhere else.

`tierzero.cli.launch:run` is the console script's entry point and `python -m tierzero.cli` runs
it too; `tierzero.cli.main.main(argv)` runs a command line from Python. Nothing is imported here,
so that the script's first import of tierzero costs no time in which Ctrl-C is not yet ours
(cli/launch.py).
"""
