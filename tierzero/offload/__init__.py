"""The tiers, each behind `TierStorage` (base.py) with the `TierTraits` it declares: the compute
device, pinned host memory (`cpu`) and NVMe (`nvme`, with its disk beneath in disk/)."""
