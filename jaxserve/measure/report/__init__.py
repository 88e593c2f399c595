"""`jaxserve report`: the planner's predictions against the engine's measurements, as JSON, markdown and a plot."""
