"""`make reproduce`: the plan of stages, the plan check, their scheduling as processes (locally or as Slurm jobs),
stops and time left. What the runs wrote is read back and written up by lmcal.reporting."""
