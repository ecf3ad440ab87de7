"""The disk under the NVMe tier: its files and their owners, the chunked I/O queue and its backends,
and the clock of how long the disk was busy."""
