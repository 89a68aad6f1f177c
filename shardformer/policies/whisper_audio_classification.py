"""WhisperForAudioClassification: Whisper's audio encoder (`encoder`, the model's own base), then `projector` and
`classifier` over the mean of its output. Under tp its layers split as WhisperPolicy splits the encoder (its tables,
filtered to the encoder); under pp the stages split `encoder.layers`: the first stage holds the encoder's entry (two
convolutions over `input_features`, then fixed positions), which a later stage runs as zeros shaped like their
outputs (its first layer takes the received hidden states instead); the last holds `encoder.layer_norm`,
`projector` and `classifier`, replicated over tp. With `use_weighted_layer_sum` the classifier reads every layer's
hidden states, which a pipeline does not send on: pp is refused there."""
from typing import Dict, List, TypeVar

from .base import SHAPED, Policy
from .whisper import WhisperPolicy

T = TypeVar("T")


def _encoder_only(table: Dict[str, T]) -> Dict[str, T]:
    """The entries of a WhisperPolicy table that apply to the encoder (all but the decoder's own)."""
    return {pattern: value for pattern, value in table.items() if not pattern.startswith("decoder.")}


class WhisperForAudioClassificationPolicy(Policy):
    """Whisper's encoder under tp and pp, with the classification head on the last stage (see the module docstring)."""
    layers = WhisperPolicy.encoder_layers
    entry = dict.fromkeys(WhisperPolicy.encoder_entry, SHAPED)
    exit = (*WhisperPolicy.encoder_exit, "projector", "classifier")
    tp_plan = _encoder_only(WhisperPolicy.tp_plan)
    tp_attributes = _encoder_only(WhisperPolicy.tp_attributes)
    tp_divisible = tuple(attr for attr in WhisperPolicy.tp_divisible if attr.startswith("encoder_"))
    local_rng_modules = tuple(_encoder_only(dict.fromkeys(WhisperPolicy.local_rng_modules)))

    def check_split(self, split: List[int]) -> None:
        if self.stage_manager.num_stages > 1 and self.model.config.use_weighted_layer_sum:
            raise NotImplementedError(
                f"{type(self.model).__name__} with use_weighted_layer_sum=True classifies a weighted sum of every "
                f"encoder layer's hidden states, but a pipeline stage sends on only its last layer's: train it with "
                f"pp_size=1 (tp is supported), or set use_weighted_layer_sum=False.")
        super().check_split(split)
