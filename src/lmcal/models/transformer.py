"""A GPT-style transformer trained by this project: `transformers`' GPT2LMHeadModel built from a GPT2Config over a
word-level vocabulary, behind the same network interface as the AWDLSTM, so that LMModule, the data module
and the checkpoints serve both.

    net = GPTLM(vocab_size=10_000, n_positions=256, n_embd=256, n_layer=4, n_head=4)
    output, raw, hidden = net(tokens, net.init_hidden(B))   # tokens [T, B] -> output [T, B, E]; hidden stays []
    logits = net.logits(output)                             # [T, B, V]

A window is read from scratch (no state carries between windows: `hidden` is always []), so T <= n_positions. The
analysis sees it as a Hugging Face model (`net.step_lm()`, an HFCausalLM), and `save_hf` writes a folder that
`model=hf model.name_or_path=FOLDER` loads: the model from save_pretrained and a word-level tokenizer of the corpus's
vocabulary made with `tokenizers`, which turns each line break into <eos> as the corpus does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from lmcal.errors import LmcalError
from lmcal.models.hf import HFCausalLM, import_transformers


class GPTLM(nn.Module):
    """GPT2LMHeadModel (learned positions, tied input and output embeddings) over `vocab_size` words."""

    memory_tau = None  # always full-context: a window is read whole

    def __init__(self, vocab_size: int, n_positions: int = 256, n_embd: int = 256, n_layer: int = 4,
                 n_head: int = 4, dropout: float = 0.1, attn_dropout: float = 0.1, embd_dropout: float = 0.1,
                 n_inner: int | None = None):
        super().__init__()
        tf = import_transformers()
        self.vocab_size, self.n_positions, self.emb_size = vocab_size, n_positions, n_embd
        config = tf.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                               n_head=n_head, n_inner=n_inner, resid_pdrop=dropout, attn_pdrop=attn_dropout,
                               embd_pdrop=embd_dropout, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                               tie_word_embeddings=True,
                               # GPT-2's tanh GELU as one fused kernel (gelu_new is a chain of elementwise ops: 11%
                               # of a CPU training step)
                               activation_function="gelu_pytorch_tanh")
        config._attn_implementation = "sdpa"
        self.model = tf.GPT2LMHeadModel(config)

    @property
    def decoder(self) -> nn.Linear:
        return self.model.lm_head  # [V, E], tied to the input embedding

    def init_hidden(self, batch_size: int) -> list:
        return []

    def forward(self, tokens: torch.Tensor, hidden=None):
        """tokens [T, B] -> (output [T, B, E] after the final layer norm, the same, []): one window from scratch."""
        T = tokens.size(0)
        if T > self.n_positions:
            raise LmcalError(f"A window of {T} tokens is longer than the transformer's context (model.n_positions="
                             f"{self.n_positions}); set data.bptt <= {self.n_positions - 1}.")
        h = self.model.transformer(input_ids=tokens.t()).last_hidden_state  # [B, T, E]
        out = h.transpose(0, 1)  # [T, B, E]
        return out, out, []

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(output)  # [..., V]

    def step_lm(self):
        """The network as a StepLM (lmcal.models.hf.HFCausalLM), in eval mode."""
        return HFCausalLM(self.model.eval())

    def save_hf(self, folder: str | Path, itos: list[str], label: str | None = None) -> Path:
        """A complete Hugging Face folder: the model (save_pretrained) and a word-level tokenizer of `itos`; `label`
        (the model's name in tables) is kept in its config.json as `lmcal_label`, the name model=hf shows."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if label:
            self.model.config.lmcal_label = str(label)
        self.model.save_pretrained(folder)
        word_tokenizer(itos).save_pretrained(folder)
        return folder


def word_tokenizer(itos: list[str]):
    """A PreTrainedTokenizerFast for a word-level corpus (data.corpora: words split on whitespace, <eos> ending each
    line, <unk> for the rest): line breaks become <eos>, words map to their ids, unknown words to <unk>."""
    tf = import_transformers()
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {w: i for i, w in enumerate(itos)}
    unk = "<unk>" if "<unk>" in vocab else None
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    if "<eos>" in vocab:
        tok.normalizer = normalizers.Replace(Regex(r"\r?\n"), " <eos> ")
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, eos_token="<eos>" if "<eos>" in vocab
                                      else None, model_max_length=int(1e9))
