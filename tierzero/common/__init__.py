"""The words every layer shares: tiers, kinds and slice keys, byte sizes, in-flight transfers, cache files.

The bottom of the import graph: nothing here imports any other part of tierzero.
"""
