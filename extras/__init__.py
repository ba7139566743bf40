"""Commands beside training, which a reader of one step never opens: evaluate a checkpoint
(`python -m extras.eval`), replay a dumped step (`python train.py --replay`), plot a run
(`python -m extras.plot`)."""
