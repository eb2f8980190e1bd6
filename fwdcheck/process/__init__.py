"""Where the model runs, supervised: the supervisor that owns the clock, the exit code and the output files; the
worker the model runs in; the fork server workers are forked from; the events between them; launched and
distributed ranks. Nothing here judges a model: a run of one model is fwdcheck.run."""
