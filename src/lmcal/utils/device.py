"""One precision policy for every entry point: TF32 off, so cuDNN's LSTM and the decoder and lookahead matmuls all run
in full float32 (the lookahead's two paths then agree to float32 rounding, not TF32's 1e-3). Set explicitly once per
process by `apply_precision_policy` (PyTorch's own defaults differ between matmul and cuDNN), and recorded in
results.json by `precision_policy`. On a machine without CUDA the flags are set all the same and change nothing.
"""

from __future__ import annotations

import torch

TF32 = False  # the policy: full float32 matmuls and convolutions/RNNs on CUDA


def apply_precision_policy() -> dict:
    """Sets the TF32 flags of matmuls and cuDNN to the policy; returns precision_policy()."""
    torch.backends.cuda.matmul.allow_tf32 = TF32
    torch.backends.cudnn.allow_tf32 = TF32
    torch.set_float32_matmul_precision("high" if TF32 else "highest")
    return precision_policy()


def precision_policy() -> dict:
    """The flags in force, as recorded in results.json."""
    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
