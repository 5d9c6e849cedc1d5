"""Drafter training: the target writes the data, a DFlash drafter learns to draft it.

prompts -> data (generation through our Engine, shards on disk) -> features (frozen target,
dense causal forward) + batching (random anchors) + mask + model (block forward) + loss ->
trainer -> export (z-lab directory). `blockspec train-drafter` (cmd.py) runs it end to end.
"""
