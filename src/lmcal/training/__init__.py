"""The Lightning layer of `python -m lmcal.train`: the data and training modules and the callbacks."""
