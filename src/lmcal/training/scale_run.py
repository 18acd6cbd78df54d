"""`python -m lmcal.train`'s scale record (lmcal.stages.scale_record): after the analysis stages, the trained
network's parameters, the tokens it was trained on and the corpus it learned, beside the stages' results."""

from __future__ import annotations

from pathlib import Path

from lmcal.models.step_lm import as_step_lm
from lmcal.stages.scale_record import corpus_info, family_of, record_run
from lmcal.training.callbacks import best_model_scores


def record_training(out: Path, trainer, dm, metrics: dict, stages: dict, logger=None) -> dict | None:
    """scale.json in the run folder when the entropy_rate stage ran: the best checkpoint's network (the one the stages
    analysed), `metrics`' parameters, training tokens (tokens trained on, every epoch counted) and test CE; the
    distinct training tokens (data.max_train_tokens) as data_tokens."""
    if not stages.get("entropy_rate"):
        return None
    net = best_model_scores(trainer, dm)["net"]
    return record_run(out, stages, as_step_lm(net), dm.tokens("test"), logger,
                      context=getattr(net, "n_positions", None), model=metrics["model"],
                      family=family_of(metrics["model"]), corpus=dm.name, params=metrics["params"],
                      train_tokens=metrics["train_tokens"], test_ce=metrics["test_ce_nats"],
                      data_tokens=int(dm.tokens("train").numel()), epochs=metrics["epochs"],
                      **corpus_info(dm.prepare().info))
