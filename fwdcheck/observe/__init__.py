"""Observing the model as it runs: every attention call it makes (a torch function mode with forward hooks), and
every module's output (forward hooks alone). What is observed are plain records; judging them is the checks' work.

observer.py runs the pass; records.py holds what it fills; dispatcher.py is the mode, which hands each attention
call to the reader its kernel family registered in table.py (kernels/, one module per family); masks.py decodes
masks for them; frames.py is what the module hooks learn; locations.py names the model line that made a call."""
