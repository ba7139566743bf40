"""What a step runs on but never decides: the SGLang engine process (engine.py), the policy model
and its optimizer (model.py), ranks and their collectives (parallel.py), checkpoints
(checkpoint.py), memory estimates (estimate.py), LoRA (lora.py), seeds (seeds.py). A run is
assembled once before the first step by assemble.py, above them. A reader of the step need
not open these."""
