"""Vision-language and speech models train under tp x pp exactly as one process (loss, every gradient, parameters
after AdamW; fp32, 1e-5): the vision encoder and projector on the first stage (which merges the image features into
the embeddings), the text decoder split over tp and pp, `pixel_values` given to the first stage only, the model's
other inputs (`image_grid_thw` and `mm_token_type_ids` for Qwen-VL's M-RoPE positions, `token_type_ids` for
Gemma 3's bidirectional image attention) to every stage, and pixel values that count images or patches, not
samples, split into microbatches with their samples. Whisper: the audio encoder, then the decoder, as BART.

Batches (shardformer/image_batches.py, from each config) are laid out as each family's processor lays them out: a
run of `image_token_id` placeholders per image, as many as the projector makes features (LLaVA, Mistral3, Idefics3:
4; Gemma 3: `mm_tokens_per_image` between begin/end-of-image tokens; Qwen-VL: t*h*w / merge**2 between vision
start/end tokens, `pixel_values` one row per patch), 0 to 2 images per sample, labels -100 on image tokens and
padding."""
import copy
from typing import Dict

import pytest
import torch
import torch.distributed as dist
from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Model, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                          Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlavaConfig,
                          LlavaForConditionalGeneration, Mistral3Config, Mistral3ForConditionalGeneration,
                          MistralConfig, PixtralVisionConfig, SamConfig, SamModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, SiglipVisionConfig, SmolVLMConfig,
                          SmolVLMForConditionalGeneration, SmolVLMVisionConfig, WhisperConfig,
                          WhisperForAudioClassification, WhisperForConditionalGeneration)

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.image_batches import image_batch, vlm_batch
from shardformer.multimodal_batch import image_rows
from tests import model_utils as mu
from tests.dist_utils import run_distributed

IMG, BOI, EOI, VIDEO = 99, 97, 98, 96   # placeholder, begin / end of image (vision start / end), video
TEXT = dict(vocab_size=mu.VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


def llava(n: int = 4) -> LlavaForConditionalGeneration:
    vision = CLIPVisionConfig(**SMALL_VISION, image_size=8, patch_size=4, projection_dim=16)  # 4 patches + CLS
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=mu.llama_config(n),
                                                     image_token_id=IMG))


QWEN_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}
QWEN_TOKENS = dict(image_token_id=IMG, video_token_id=VIDEO, vision_start_token_id=BOI, vision_end_token_id=EOI)


def qwen2_5_vl(n: int = 4) -> Qwen2_5_VLForConditionalGeneration:
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=8, out_hidden_size=32, fullatt_block_indexes=[1])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**QWEN_TEXT, "num_hidden_layers": n}, vision_config=vision, **QWEN_TOKENS))


def qwen2_vl(n: int = 4) -> Qwen2VLForConditionalGeneration:
    vision = dict(depth=2, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config={**QWEN_TEXT, "num_hidden_layers": n}, vision_config=vision, **QWEN_TOKENS))


def qwen3_vl(n: int = 4) -> Qwen3VLForConditionalGeneration:
    # the vision layers' features in deepstack_visual_indexes are added to the first 2 decoder layers' outputs
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={**QWEN_TEXT, "num_hidden_layers": n, "head_dim": 8}, vision_config=vision, **QWEN_TOKENS))


def gemma3(n: int = 4) -> Gemma3ForConditionalGeneration:
    text = Gemma3TextConfig(**TEXT, num_hidden_layers=n, head_dim=8, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"] * (n // 2))
    vision = SiglipVisionConfig(**SMALL_VISION, image_size=8, patch_size=2)  # 16 patches pooled to 4 tokens
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=IMG, boi_token_index=BOI,
                                                        eoi_token_index=EOI))
    # transformers initializes the projection to zeros: image features 0, which the first layer's RMSNorm scales by
    # 1/sqrt(eps), so that fp32 rounding would dominate the comparison; a trained projection is not zero
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.05)
    return model


def idefics3(n: int = 4) -> Idefics3ForConditionalGeneration:
    vision = Idefics3VisionConfig(**SMALL_VISION, image_size=8, patch_size=2)  # 16 patches, shuffled to 4 tokens
    return Idefics3ForConditionalGeneration(Idefics3Config(vision_config=vision, text_config=mu.llama_config(n),
                                                           image_token_id=IMG, scale_factor=2))


def smolvlm(n: int = 4) -> SmolVLMForConditionalGeneration:
    vision = SmolVLMVisionConfig(**SMALL_VISION, image_size=8, patch_size=2)
    return SmolVLMForConditionalGeneration(SmolVLMConfig(vision_config=vision, text_config=mu.llama_config(n),
                                                         image_token_id=IMG, scale_factor=2))


def mistral3(n: int = 4) -> Mistral3ForConditionalGeneration:
    vision = PixtralVisionConfig(**SMALL_VISION, head_dim=8, image_size=8, patch_size=2)  # 16 patches merged to 4
    text = MistralConfig(**TEXT, num_hidden_layers=n, head_dim=8)
    return Mistral3ForConditionalGeneration(Mistral3Config(vision_config=vision, text_config=text,
                                                           image_token_index=IMG, spatial_merge_size=2))


def blip2(n: int = 4) -> Blip2ForConditionalGeneration:
    vision = dict(**SMALL_VISION, image_size=8, patch_size=4)  # 4 patches + CLS, read by 4 query tokens
    qformer = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   encoder_hidden_size=16, vocab_size=mu.VOCAB, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)
    model = Blip2ForConditionalGeneration(Blip2Config(vision_config=vision, qformer_config=qformer,
                                                      text_config=mu.opt_config(n).to_dict(), num_query_tokens=4,
                                                      image_token_index=IMG))
    # query tokens initialized to zeros: the Q-Former's LayerNorm of them scales their gradient by 1/sqrt(eps), so
    # that fp32 rounding would dominate the comparison (as Gemma 3's projection below); trained ones are not zero
    torch.nn.init.normal_(model.query_tokens, std=0.05)
    return model


def blip2_model(n: int = 4) -> Blip2Model:
    """Blip2Model: the same modules as Blip2ForConditionalGeneration (its language model an OPT causal LM)."""
    full = blip2(n)
    model = Blip2Model(full.config)
    model.load_state_dict(full.state_dict())
    return model


def sam(n: int = 2) -> SamModel:
    """8 x 8 patches: windows of 4 x 4 in the first layer, global attention in the second."""
    vision = dict(hidden_size=16, mlp_dim=32, num_hidden_layers=n, num_attention_heads=2, image_size=32, patch_size=4,
                  output_channels=16, window_size=4, global_attn_indexes=[1], num_pos_feats=8, initializer_range=0.2)
    prompt = dict(hidden_size=16, image_size=32, patch_size=4, image_embedding_size=8, mask_input_channels=4)
    decoder = dict(hidden_size=16, mlp_dim=32, num_attention_heads=2, num_hidden_layers=2, iou_head_hidden_dim=16)
    # weights of std 0.2 (~ 1 / sqrt(width 16)): the defaults (0.02; the encoder's 1e-10) leave the encoder's and
    # the decoder's attention gradients at 1e-8 to 1e-14, where a comparison at 1e-5 could not fail
    model = SamModel(SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder,
                               initializer_range=0.2))
    # relative and absolute positions initialized to zeros: trained ones are not (and the tables must be used)
    for name, p in model.named_parameters():
        if name.rpartition(".")[2] in ("rel_pos_h", "rel_pos_w", "pos_embed"):
            torch.nn.init.normal_(p, std=0.05)
    return model


def sam_batch(batch_size: int, seed: int) -> Dict[str, torch.Tensor]:
    return image_batch(sam(1), batch_size, torch.Generator().manual_seed(seed))


def sam_loss(outputs, batch) -> torch.Tensor:
    """Masks (32 x 32, as the images) of the pixels whose first channel is positive; IoU scores: their share."""
    target = (batch["pixel_values"][:, None, None, 0] > 0).float()
    return ((outputs.pred_masks - target) ** 2).mean() + ((outputs.iou_scores - target.mean((-2, -1))) ** 2).mean()


def whisper(n: int = 2) -> WhisperForConditionalGeneration:
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=mu.VOCAB, num_mel_bins=8, encoder_layers=n, decoder_layers=n, encoder_attention_heads=4,
        decoder_attention_heads=4, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))


def whisper_classifier(n: int = 2, weighted: bool = False) -> WhisperForAudioClassification:
    return WhisperForAudioClassification(WhisperConfig(
        num_mel_bins=8, encoder_layers=n, encoder_attention_heads=4, d_model=32, encoder_ffn_dim=64,
        max_source_positions=8, classifier_proj_size=16, num_labels=3, use_weighted_layer_sum=weighted))


def audio_class_batch(batch_size: int, seed: int) -> Dict[str, torch.Tensor]:
    """Log-mel features (batch, mel bins, 2 * max_source_positions) and one class per sample."""
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(batch_size, 8, 16, generator=g),
            "labels": torch.randint(0, 3, (batch_size,), generator=g)}


def audio_batch(batch_size: int, seed: int) -> Dict[str, torch.Tensor]:
    """Log-mel features (batch, mel bins, 2 * max_source_positions) and transcripts padded with -100."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, mu.VOCAB, (batch_size, 10), generator=g)
    labels[0, -3:] = -100
    return {"input_features": torch.randn(batch_size, 8, 16, generator=g), "labels": labels}


for _kind, _build in (("llava", llava), ("qwen2_5_vl", qwen2_5_vl), ("qwen2_vl", qwen2_vl), ("qwen3_vl", qwen3_vl),
                      ("gemma3", gemma3), ("idefics3", idefics3), ("smolvlm", smolvlm), ("mistral3", mistral3),
                      ("blip2", blip2), ("blip2_model", blip2_model)):
    mu.MODELS[_kind] = _build
    _model = _build(2)
    mu.BATCHES[_kind] = lambda b, s, m=_model: vlm_batch(m, b, s)
    _rows = image_rows(_model.config)
    if _rows is not None:  # (Idefics3: pixel values per sample)
        mu.RAGGED[_kind] = _rows
mu.MODELS["whisper"] = whisper
mu.MODELS["sam"], mu.BATCHES["sam"], mu.CRITERIA["sam"] = sam, sam_batch, sam_loss
mu.BATCHES["whisper"] = audio_batch
mu.MODELS["whisper_classifier"], mu.BATCHES["whisper_classifier"] = whisper_classifier, audio_class_batch
mu.MODELS["whisper_classifier_weighted"] = lambda n: whisper_classifier(n, weighted=True)
mu.BATCHES["whisper_classifier_weighted"] = audio_class_batch


def _four_ranks(path: str) -> None:
    for kind in ("llava", "qwen2_5_vl", "qwen2_vl", "gemma3", "idefics3", "smolvlm", "mistral3"):
        mu.check_training(kind, tp_size=2, pp_size=2, num_microbatches=4)
    # deepstack: the first stage holds the 2 layers the vision features are added to, and one more
    mu.check_training("qwen3_vl", tp_size=2, pp_size=2, num_microbatches=4, num_layers_per_stage=[3, 1])
    mu.check_training("whisper", layers=2, tp_size=2, pp_size=2, num_microbatches=4)  # encoder | decoder
    # one layer per virtual stage (dp=2): each chunk's layers see their own slice of the text config's layer_types
    mu.check_training("gemma3", pp_size=2, pp_style="zbv", num_model_chunks=2, num_microbatches=4)
    # Whisper: a stage holding the encoder and the first decoder layer (the next starts inside the decoder)
    mu.check_training("whisper", layers=2, pp_size=2, num_microbatches=2, num_layers_per_stage=[3, 1])
    # Whisper's audio classifier: the encoder's entry on the first stage, projector and classifier on the last
    mu.check_training("whisper_classifier", tp_size=2, pp_size=2, num_microbatches=2)
    # (its weighted sum over every layer's hidden states: tp only, pp refused)
    mu.check_training("whisper_classifier_weighted", tp_size=2)
    mu.check_evaluation("qwen2_5_vl", tp_size=2, pp_size=2, num_microbatches=4)  # full logits on the last stage
    _checkpoint("qwen2_5_vl", path)


def _checkpoint(kind: str, path: str) -> None:
    """Saved from tp=2 x pp=2 (the encoders on the first stage only), the model loads with from_pretrained."""
    reference = mu.build(kind)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2))
    model, *_ = booster.boost(copy.deepcopy(reference))
    booster.save_model(model, f"{path}/{kind}", shard=True, size_per_shard=1)
    dist.barrier()
    loaded = type(reference).from_pretrained(f"{path}/{kind}").state_dict()
    for name, p in reference.state_dict().items():
        mu.assert_close(loaded[name], p, f"{kind} checkpoint {name}")
    dist.barrier()


def test_vision_language_and_speech_models_train_exactly_under_tp_and_pp(tmp_path):
    run_distributed(4, _four_ranks, str(tmp_path))


def test_images_split_into_microbatches_with_their_samples():
    """Qwen2.5-VL's patches (rows per image: t*h*w of its grid) and LLaVA's images go with the samples whose
    placeholder tokens they fill; a microbatch without images gets no pixel values."""
    from booster_plugin.core.microbatches import split_batch
    for kind in ("qwen2_5_vl", "llava"):
        batch = mu.make_batch(kind, 6, seed=1)  # samples hold 0, 1, 2, 0, 1, 2 images
        parts = split_batch(batch, 3, None, mu.RAGGED[kind])
        assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
        # sample pairs (0, 1), (2, 3), (4, 5) hold 1, 2 and 3 images; Qwen's alternate 16 and 32 patches
        if kind == "qwen2_5_vl":
            assert [p["image_grid_thw"].shape[0] for p in parts] == [1, 2, 3]
            assert [p["pixel_values"].shape[0] for p in parts] == [16, 16 + 32, 16 + 32 + 16]
        else:
            assert [p["pixel_values"].shape[0] for p in parts] == [1, 2, 3]
        torch.testing.assert_close(torch.cat([p["pixel_values"] for p in parts]), batch["pixel_values"])
    lone = split_batch(mu.make_batch("llava", 2, seed=1), 2, None, mu.RAGGED["llava"])
    assert "pixel_values" not in lone[0] and lone[1]["pixel_values"].shape[0] == 1


def test_placeholders_that_do_not_make_whole_images_are_refused():
    from booster_plugin.core.microbatches import split_batch
    batch = mu.make_batch("qwen2_5_vl", 4, seed=1)
    batch["input_ids"][1, 2] = 5  # one placeholder of sample 1's image replaced by text
    with pytest.raises(ValueError, match="do not add up to whole images"):
        split_batch(batch, 2, None, mu.RAGGED["qwen2_5_vl"])


class _TwoStages:
    """A stage manager without processes that splits the layers 2 + 2."""
    num_stages = 2

    def layers_per_virtual_stage(self, num_layers, costs=None):
        return [2, num_layers - 2]


def test_splits_the_models_own_forward_cannot_run_are_refused():
    """Whisper: a stage starting inside the audio encoder (3 + 3 layers split 2 + 4); Qwen3-VL: a first stage that
    does not hold the decoder layers the vision features are added to, and one more; Whisper's audio classifier
    with a weighted sum over every layer's hidden states."""
    from shardformer.policies import get_autopolicy
    for model, error in ((whisper(3), "all 3 encoder layers"), (qwen3_vl(4), "first entry is at least 3"),
                         (whisper_classifier(4, weighted=True), "use_weighted_layer_sum=True classifies")):
        policy = get_autopolicy(model)
        policy.set_model(model)
        policy.set_pipeline_stage_manager(_TwoStages())
        with pytest.raises(NotImplementedError, match=error):
            policy.layers_per_stage()


@pytest.mark.parametrize("build, reason", [(blip2, "runs the vision encoder and Q-Former on every call"),
                                           (sam, "runs the whole vision encoder from pixel_values")])
def test_blip2_and_sam_pipelines_are_refused_with_the_reason(build, reason):
    from shardformer.policies import get_autopolicy
    model = build(4)
    policy = get_autopolicy(model)
    policy.set_model(model)
    policy.set_pipeline_stage_manager(_TwoStages())
    with pytest.raises(NotImplementedError, match=reason):
        policy.layers_per_stage()


def _sequence_parallel() -> None:
    # sequence parallelism over its own group on vision-language models: the layers read the text config
    for kind in ("llava", "qwen2_5_vl", "gemma3"):
        for mode in ("all_to_all", "ring_attn"):
            mu.check_training(kind, sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode)


def test_vision_language_models_under_sequence_parallelism():
    run_distributed(2, _sequence_parallel)


def _tensor_parallel() -> None:
    # BLIP-2 (OPT): the language model split over tp, the vision encoder, Q-Former and projector replicated
    mu.check_training("blip2", tp_size=2)
    mu.check_training("blip2_model", tp_size=2)
    # SAM: the vision encoder's and the mask decoder's attentions and MLPs split, the rest replicated
    mu.check_training("sam", layers=2, tp_size=2)


def test_blip2_and_sam_train_exactly_under_tp():
    run_distributed(2, _tensor_parallel)
