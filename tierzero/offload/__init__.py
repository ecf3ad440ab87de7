"""Tiers below the compute device: pinned host memory (`cpu`) and NVMe (`nvme`)."""
