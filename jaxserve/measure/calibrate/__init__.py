"""`jaxserve calibrate`: microbenchmarks and engine steps that fit the planner's coefficients to this machine."""
