"""The YAML config (schema: validated by pydantic, every problem one line, paths resolved) and what a config names:
the reference model's bugs, code by reference, rename rules, hub ids, the starter configs of `fwdcheck init`.
Free of torch: the command line validates a config before any model loads."""
