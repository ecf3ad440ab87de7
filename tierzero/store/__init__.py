"""The tiered store: every slice's home tier and fetched copy (tiered.py, records.py), and its byte ledger (ledger.py)."""

from tierzero.store.ledger import StoreReport, Use
from tierzero.store.tiered import SliceState, TieredStore

__all__ = ["SliceState", "StoreReport", "TieredStore", "Use"]
