"""The model runner: the target's forward (eager or CUDA graphs), KV storage, masks, attention, the
output layer."""
