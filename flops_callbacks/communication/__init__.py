"""Communication: where a multi-process step's time goes, from ``torch.profiler``'s trace to its figures.
Owns the recording, the interval algebra, the split per phase, the job's figures and their report rows."""
