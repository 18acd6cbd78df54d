"""The corpora (PTB and WikiText-2 with their checksummed downloads, a synthetic stand-in), batching and BPTT, and
the synthetic Markov source whose answers are known exactly. Imports nothing of lmcal but its errors."""
