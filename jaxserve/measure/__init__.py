"""Measuring the engine, apart from running it: load generators and results (`bench`), calibration of the planner's
coefficients (`calibrate`), the measured-vs-predicted report (`report`) and model quality (`eval`)."""
