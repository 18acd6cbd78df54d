"""Every reference number of Braverman et al. (ICML 2020) that lmcal prints beside its own, in one place.

Perplexities are per word (per model token for GPT-2); memory-table entries are in nats.
"""

from __future__ import annotations

# Table 1: test perplexity against the generations' entropy rate (exp of the entropy at t = horizon = 700).
TABLE1 = [
    {"model": "AWD-LSTM 400/1150/3 (paper)", "corpus": "PTB", "test_ppl": 58.3, "entrate_ppl": 93.1},
    {"model": "GPT-2 (paper)", "corpus": "WebText", "test_ppl": 23.7, "entrate_ppl": 61.2},
]
AWD_LSTM_PTB = TABLE1[0]
GPT2 = TABLE1[1]

HORIZON = 700  # Table 1's EntRate: the entropy at t = 700

# The paper's AWD-LSTM after 500 epochs (validation / test perplexity), quoted in the text.
AWD_LSTM_PTB_VAL_TEST = (64.3, 58.3)

# Section 5, the memory table for the PTB AWD-LSTM: tau -> (CE(P || P~_tau), I_tau upper bound, alpha*), nats.
MEMORY_PTB = {
    5: (4.8144, 0.6180, 0.003515), 10: (4.5258, 0.4226, -0.01041), 15: (4.4166, 0.2678, -0.00447),
    20: (4.3347, 0.2485, -0.02268), 25: (4.2777, 0.2274, -0.01814), 30: (4.2408, 0.2143, -0.02323),
}

# Section 4 (Figure 3), in words: lookahead calibration lowers the generations' perplexity by almost 20 points and
# leaves test perplexity unchanged.
CALIBRATION_EFFECT = "generations' perplexity falls by almost 20 points, test perplexity unchanged"
CALIBRATION_PPL_DROP = 20.0  # "almost 20 points", from the EntRate of TABLE1's AWD-LSTM (93.1): -0.24 nats


# Cao, Valiant & Liang, "On the Entropy Calibration of Language Models" (NeurIPS 2025; arXiv 2511.11966), the
# reference of the scale sweep (lmcal.reporting.scale_report). They fit the gap between the entropy of generations and
# the log loss on human text against model size, log gap = a + b log N, for families of 0.5B-70B parameters, and
# report exponents for text "close to 0" (faster for code); about -0.05 is the figure summaries of the paper quote.
CVL = "Cao, Valiant & Liang (NeurIPS 2025)"
CVL_TEXT_EXPONENT = -0.05  # gap ~ N^b for text, b "close to 0": about -0.05 (check against their Figure before quoting)
CVL_SIZES = "0.5B-70B parameters"


def cvl_predicted_exponent(tail_exponent: float) -> float:
    """The exponent of the gap against the amount of data m that CVL's simplified setting predicts for data whose
    frequencies follow a power law of exponent s, as we read it: that of the missing mass of such a law after m
    draws, m^-(1 - 1/s), near 0 for s near 1 (their abstract's statement) and -1/2 for s = 2."""
    return -(1.0 - 1.0 / float(tail_exponent))
