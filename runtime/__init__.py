"""What a step runs on but never decides: the SGLang engine process (engine.py), the policy model
and its optimizer (model.py), ranks and their collectives (parallel.py), checkpoints
(checkpoint.py), and building a run once before the first step (run.py). A reader of the step need
not open these."""
