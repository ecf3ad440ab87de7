"""The engine: one stage, one tiered store, one prefetcher and one optimizer behind `Engine`.

`from tierzero.engine import Engine` was the import path before the engine became a package;
it keeps working for one release (use `tierzero.Engine`).
"""

from tierzero.engine.engine import Engine

__all__ = ["Engine"]
