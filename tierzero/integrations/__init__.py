"""The trainers users already run (transformers, TRL, Accelerate), driving a tierzero engine."""
