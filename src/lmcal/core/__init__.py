"""The maths, on the `StepLM` protocol and plain tensors: generation entropy curves, lookahead and lookahead
calibration, exponential-family fits, future-entropy heads, decoders, context rows and the memory bound. No
Lightning, Hydra, W&B or files, so every estimator is checked against exact answers."""
