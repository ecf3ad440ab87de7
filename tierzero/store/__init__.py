"""The tiered store: every slice's home tier and fetched copy (tiered.py, records.py), its byte ledger
(ledger.py), and the host cache of NVMe-homed slices (cache_policy.py, nvme_cache.py)."""

from tierzero.store.ledger import StoreReport, Use
from tierzero.store.tiered import SliceState, TieredStore

__all__ = ["SliceState", "StoreReport", "TieredStore", "Use"]
