"""`tierzero estimate`: bytes per tier, NVMe traffic and step-time floors of a config, before anything is allocated."""

from tierzero.estimate.estimator import Bandwidth, Estimate, TierEstimate, estimate

__all__ = ["Bandwidth", "Estimate", "TierEstimate", "estimate"]
