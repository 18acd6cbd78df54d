import pytest
import pytorch_lightning as pl
import torch

from lmcal.models.checkpoint import load_net
from lmcal.training.module import LMDataModule, LMModule, OptimConfig, nt_asgd_should_switch

NET = {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "emb_size": 8, "hidden_size": 16, "num_layers": 2}


def test_nt_asgd_rule():
    # fewer than nonmono+1 earlier epochs: never switch
    assert not nt_asgd_should_switch([5.0, 4.0, 3.0], 9.0, nonmono=5)
    hist = [5.0, 4.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5]
    # best outside the last 5 epochs is 4.0 (epochs 0..2 -> min 3.0)
    assert nt_asgd_should_switch(hist, 3.05, nonmono=5)
    assert not nt_asgd_should_switch(hist, 2.99, nonmono=5)
    # only the epochs before the last `nonmono` count: a recent best does not trigger
    assert not nt_asgd_should_switch([5.0, 4.0, 3.9, 1.0, 1.0, 1.0, 1.0], 3.95, nonmono=5)


class Recorder(pl.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.rows.append({"epoch": trainer.current_epoch, "idx": batch_idx, "len": batch[0].size(0),
                          "fresh_state": module._hidden is None})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows[-1]["lr"] = trainer.optimizers[0].param_groups[0]["lr"]


def fit(tmp_path, epochs=2, **kw):
    dm = LMDataModule(name="synthetic", batch_size=4, eval_batch_size=2, bptt=12, seed=3,
                      corpus_kwargs={"vocab_size": 20, "n_train": 3000, "n_valid": 400, "n_test": 400})
    module = LMModule(net=NET, vocab_size=dm.vocab_size, optim=OptimConfig(lr=5.0, **kw), bptt=12)
    rec = Recorder()
    trainer = pl.Trainer(max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path,
                         callbacks=[rec])
    trainer.fit(module, datamodule=dm)
    return module, rec.rows, trainer


def test_lr_scaled_per_step_state_carried_and_reset_each_epoch(tmp_path):
    _, rows, _ = fit(tmp_path)
    assert len({r["len"] for r in rows}) > 3  # variable lengths
    for r in rows:
        assert r["lr"] == pytest.approx(5.0 * r["len"] / 12)
        assert r["fresh_state"] == (r["idx"] == 0)
    # a new schedule each epoch (seeded by epoch)
    e0 = [r["len"] for r in rows if r["epoch"] == 0]
    e1 = [r["len"] for r in rows if r["epoch"] == 1]
    assert e0 != e1


def test_cosine_schedule_decays_to_zero_over_the_run(tmp_path):
    _, rows, trainer = fit(tmp_path, epochs=2, schedule="cosine")
    factors = [r["lr"] / (5.0 * r["len"] / 12) for r in rows]
    assert factors[0] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[:-1], factors[1:], strict=True))  # monotone decay
    assert factors[-1] < 0.01
    mid = [f for r, f in zip(rows, factors, strict=True) if r["epoch"] == 1 and r["idx"] == 0][0]
    assert mid == pytest.approx(0.5)  # half-way through the run: cos(pi/2)


def test_averaging_is_the_mean_of_the_iterates():
    module = LMModule(net=NET, vocab_size=20)
    module.start_averaging()
    iterates = [{n: p.detach().clone() for n, p in module.net.named_parameters()}]
    for _ in range(3):
        with torch.no_grad():
            for p in module.net.parameters():
                p.add_(torch.randn_like(p))
        module._update_average()
        iterates.append({n: p.detach().clone() for n, p in module.net.named_parameters()})
    for n, _ in module.net.named_parameters():
        torch.testing.assert_close(module.avg[n], torch.stack([it[n] for it in iterates]).mean(0))
    before = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    with module.averaged_weights():
        for n, p in module.net.named_parameters():
            torch.testing.assert_close(p, module.avg[n])
    for n, p in module.net.named_parameters():  # restored afterwards
        assert torch.equal(p, before[n])


def test_checkpoint_holds_averaged_weights_and_resume_restores_raw(tmp_path):
    module = LMModule(net=NET, vocab_size=20)
    module.start_averaging()
    with torch.no_grad():
        for p in module.net.parameters():
            p.add_(1.0)  # the raw iterate moves away from the average
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)
    path = tmp_path / "x.ckpt"
    torch.save(ckpt, path)
    net, _ = load_net(path)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, module.avg[n])
    # resuming: the average comes back from state_dict, the iterate from raw_state_dict
    fresh = LMModule(net=NET, vocab_size=20)
    loaded = torch.load(path, weights_only=True)
    assert loaded["hyper_parameters"]["optim"] == OptimConfig().as_dict()  # plain values, read back without pickle
    fresh.on_load_checkpoint(loaded)
    fresh.load_state_dict(loaded["state_dict"])
    for n, p in fresh.net.named_parameters():
        torch.testing.assert_close(fresh.avg[n], module.avg[n])
        torch.testing.assert_close(p, dict(module.net.named_parameters())[n])


def resumed_after_switch(tmp_path):
    """A module resumed from a checkpoint written after the NT-ASGD switch (read onto the CPU, as Lightning does)."""
    module = LMModule(net=NET, vocab_size=20)
    module.start_averaging()
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "x.ckpt")
    fresh = LMModule(net=NET, vocab_size=20)
    loaded = torch.load(tmp_path / "x.ckpt", map_location="cpu", weights_only=True)
    return fresh, loaded


def test_resumed_average_follows_the_parameters_device_and_dtype(tmp_path):
    fresh, loaded = resumed_after_switch(tmp_path)
    fresh.net.double()  # parameters that are not where the checkpoint was read (float64 standing in for cuda)
    fresh.on_load_checkpoint(loaded)
    for n, p in fresh.net.named_parameters():
        assert fresh.avg[n].device == p.device and fresh.avg[n].dtype == p.dtype == torch.float64
        assert fresh.avg[n].data_ptr() != loaded["state_dict"]["net." + n].data_ptr()  # a copy, not a view


def test_average_update_after_the_module_moves_post_restore(tmp_path):
    """Lightning restores a checkpoint before it moves the module to the accelerator: the first averaging step after
    the move must not mix devices (it raised a device mismatch on CUDA, and a dtype error here, before the fix)."""
    fresh, loaded = resumed_after_switch(tmp_path)
    fresh.on_load_checkpoint(loaded)
    fresh.load_state_dict(loaded["state_dict"])
    before = {n: a.clone() for n, a in fresh.avg.items()}
    fresh.net.to(torch.float64)  # what strategy.setup does, later (a dtype standing in for cuda: meta unties weights)
    fresh._update_average()
    for n, p in fresh.net.named_parameters():
        assert fresh.avg[n].device == p.device and fresh.avg[n].dtype == p.dtype
        torch.testing.assert_close(fresh.avg[n], (before[n].double() + p.detach()) / 2)  # n_avg 1 -> 2


def test_nt_asgd_switch_starts_averaging_once():
    module = LMModule(net=NET, vocab_size=20, optim=OptimConfig(nonmono=5))
    losses = [5.0, 4.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5]
    assert [module.record_validation(v) for v in losses] == [False] * 8
    assert module.avg is None and module.val_history == losses
    assert module.record_validation(3.05)  # worse than 3.0, the best before the last 5
    assert module.avg is not None and module.n_avg == 1 and module.asgd_epoch == 0
    assert not module.record_validation(9.0)  # switched for good; no second start
    assert module.n_avg == 1
    off = LMModule(net=NET, vocab_size=20, optim=OptimConfig(nonmono=5, asgd=False))
    assert not any(off.record_validation(v) for v in losses + [9.0])
    assert off.avg is None


def test_validation_uses_averaged_weights_after_switch(tmp_path):
    module, _, trainer = fit(tmp_path, epochs=1)
    module.start_averaging()
    with torch.no_grad():
        for avg in module.avg.values():
            avg.zero_()  # an all-zero average predicts uniformly: CE = log V
    trainer.validate(module, datamodule=trainer.datamodule, verbose=False)
    assert trainer.callback_metrics["val_loss"].item() == pytest.approx(torch.log(torch.tensor(20.0)).item(), abs=1e-5)


READS = ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy")  # each a wait for the device on CUDA


def test_training_reads_the_device_only_every_log_every_n_steps(tmp_path, monkeypatch):
    """On a GPU a host read (.item(), float(), a bool of a tensor...) waits for every queued kernel, so a read each
    step makes the host's Python and the device's kernels add instead of overlap. Counted on the CPU, through the
    real Lightning path (its logger and the progress bar included), over two epochs of a length that is not a
    multiple of log_every_n_steps: every read of a training step falls on a step where Lightning writes its logs,
    and each of those steps' logs holds the values read there. (A Python number logged makes a device tensor, a
    blocking copy on CUDA: only those steps log one; the gpu tier checks the copies with CUDA's own detector.)"""
    import csv

    from pytorch_lightning.loggers import CSVLogger

    from lmcal.training.callbacks import progress_bar

    class Reads(pl.Callback):
        step, on, at = -1, False, []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.on, self.step = True, trainer.global_step  # steps taken before this one

        def on_validation_epoch_start(self, trainer, module):
            self.on = False

    reads = Reads()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            if reads.on:
                reads.at.append(reads.step)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    dm = LMDataModule(name="synthetic", batch_size=4, eval_batch_size=2, bptt=12, seed=3,
                      corpus_kwargs={"vocab_size": 20, "n_train": 3000, "n_valid": 400, "n_test": 400})
    module = LMModule(net=NET, vocab_size=dm.vocab_size, optim=OptimConfig(lr=5.0), bptt=12)
    trainer = pl.Trainer(max_epochs=2, logger=CSVLogger(tmp_path), log_every_n_steps=10, enable_checkpointing=False,
                         reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0, default_root_dir=tmp_path,
                         callbacks=[reads, progress_bar()])
    trainer.fit(module, datamodule=dm)
    steps = trainer.global_step
    assert steps > 100 and steps % 10, steps  # two epochs, not a multiple of 10
    read = {s for s in reads.at if (s + 1) % 10 == 0}  # step s + 1 taken: Lightning's log step
    # off-beat reads: only the DataLoader seeding each epoch's iterator (at an epoch's first step), and Lightning's
    # logs at the run's last step (it writes them when it stops)
    off_beat = sorted(s for s in set(reads.at) - read if s not in (0, trainer.num_training_batches, steps - 1))
    assert not off_beat, f"host reads at steps {off_beat}"
    assert len(read) == steps // 10  # each log step did read (the bar, the divergence flag, the logs)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r.get("train/lr")]
    assert len(logged) == steps // 10 and all(r["train/loss"] and r["train/tokens_per_s"] for r in logged)
    assert module.bar_metrics["train/loss"] > 0 and module.bar_metrics["tokens/s"] > 0
