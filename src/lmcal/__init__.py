"""lmcal: calibration, entropy rates and memory in language models (Braverman et al., ICML 2020)."""

__version__ = "0.1.0"
