"""Pipeline stages: what a stage holds (release.py, layer_bounds.py), how it runs the model's own forward
(forward.py; encoder_decoder.py for T5 and BART) and the per-microbatch loss weights (loss_weights.py)."""
