"""Whisper (WhisperForConditionalGeneration, WhisperModel): an audio encoder (two convolutions over the mel
`input_features` and fixed positions before its layers) and a text decoder, both with BART's layer structure
(q/k/v/out projections, fc1/fc2); the decoder's embedding is tied to `proj_out`. Under pp the encoder runs on the
first stage, whole: a stage cannot start inside it, since its entry is the convolutions, whose output no stand-in
can take the place of (the stage boundaries must lie at the encoder's end or inside the decoder)."""
from typing import Dict, List

from .bart import BartPolicy
from .base import IDENTITY, INPUT, ZEROS


class WhisperPolicy(BartPolicy):
    """BART's tp plan and stage structure with Whisper's entry and exit modules (see the module docstring)."""
    encoder_entry = {"encoder.conv1": IDENTITY, "encoder.conv2": IDENTITY, "encoder.embed_positions": IDENTITY}
    decoder_entry = {"decoder.embed_tokens": INPUT, "decoder.embed_positions": ZEROS}
    encoder_exit = ("encoder.layer_norm",)
    decoder_exit = ("decoder.layer_norm",)
    # the decoder drops its embeddings out functionally with its `dropout`: not again on received hidden states
    entry_attributes: Dict[str, Dict[str, object]] = {"decoder": {"dropout": 0.0}}
    # (its attention views keys and values by `num_heads`: this rank's heads under tp)
    tp_attributes = {"*.layers.*.self_attn": ("num_heads",), "decoder.layers.*.encoder_attn": ("num_heads",)}

    def check_split(self, split: List[int]) -> None:
        super().check_split(split)
        n_enc = self.layer_stacks()[0]
        starts = [sum(split[:i]) for i in range(1, len(split))]
        inside = [s for s in starts if 0 < s < n_enc]
        if inside:
            raise NotImplementedError(
                f"{type(self.model).__name__}: the pipeline split {split} starts a stage inside the encoder (after "
                f"its layer {inside[0] - 1}); Whisper's encoder begins with convolutions over the audio features, so "
                f"it runs whole on the first stage. Give num_layers_per_stage whose first stage holds all "
                f"{n_enc} encoder layers (e.g. [{n_enc}, ...]).")
