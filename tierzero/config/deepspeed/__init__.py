"""DeepSpeed JSON configs read as tierzero configs: the reader, the optimizer and scheduler sections,
and the translation of the rest."""
