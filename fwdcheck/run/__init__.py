"""One run of one model: the run's settings (the config with the caller's overrides), the session the checks share
(inputs, tolerances, the shared forwards, the model put back as found), the code-path matrix, and `fwdcheck diff`'s
run of two models. It hands the model to the checks and collects their results into a Report."""
