"""Communication: process groups, the collectives with their byte counters, node topology and meshes,
hybrid sharding's replicas, and ZeRO++'s quantised collectives."""
