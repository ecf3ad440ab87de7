"""The optimizer over flat fp32 slices: Adam/AdamW/SGD bit for bit with torch.optim, parameter
groups from the config's rules, and learning-rate schedules."""
