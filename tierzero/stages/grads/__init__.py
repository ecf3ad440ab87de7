"""Gradients between backward and the step: buckets for the collectives, landing in the owned slice,
the pieces of a slice torch.optim would step apart, and the global norm."""
