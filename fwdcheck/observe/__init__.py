"""Observing the model as it runs: every attention call it makes (a torch function mode with forward hooks), and
every module's output (forward hooks alone). What is observed are plain records; judging them is the checks' work."""
