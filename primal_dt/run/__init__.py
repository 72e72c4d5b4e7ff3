"""The run infrastructure both trainers share (the DT's and the classifiers'): option grammar and
checks, errors, locks, atomic outputs and checkpoints, the run monitor, devices and distribution.
It imports nothing of RL and, of the model core, only the attention registry (to check attention options)."""
