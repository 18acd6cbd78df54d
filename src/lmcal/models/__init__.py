"""The networks (the AWD-LSTM, the transformer), the `StepLM` protocol and its adapters (LSTMs, tau-limited,
Hugging Face causal LMs), the exact Markov oracles, and safe checkpoint loading. Built on lmcal.data."""
