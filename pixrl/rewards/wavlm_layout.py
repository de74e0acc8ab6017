"""Audiobox Aesthetics' released checkpoint (facebook/audiobox-aesthetics: `config.json` +
`model.safetensors` as its `AesMultiOutput` saves them) read into transformers' WavLMModel: its
encoder is the original WavLM Base+ implementation (fairseq names), which transformers' WavLM
ports layer for layer — the key renames below, the same weights. The heads (one MLP per axis and a
softmax-weighted sum of the encoder's 13 hidden states) stay as released."""

from __future__ import annotations

import re

AXES = ("CE", "CU", "PC", "PQ")  # content enjoyment, content usefulness, production complexity, production quality

#: (original WavLM name, transformers WavLMModel name), applied in order to "wavlm_model." keys
RENAMES = (
    (r"^feature_extractor\.conv_layers\.(\d+)\.0\.weight$", r"feature_extractor.conv_layers.\1.conv.weight"),
    (r"^feature_extractor\.conv_layers\.0\.2\.(weight|bias)$", r"feature_extractor.conv_layers.0.layer_norm.\1"),
    (r"^layer_norm\.(weight|bias)$", r"feature_projection.layer_norm.\1"),
    (r"^post_extract_proj\.(weight|bias)$", r"feature_projection.projection.\1"),
    (r"^encoder\.pos_conv\.0\.bias$", "encoder.pos_conv_embed.conv.bias"),
    (r"^encoder\.pos_conv\.0\.weight_g$", "encoder.pos_conv_embed.conv.parametrizations.weight.original0"),
    (r"^encoder\.pos_conv\.0\.weight_v$", "encoder.pos_conv_embed.conv.parametrizations.weight.original1"),
    (r"^encoder\.layers\.(\d+)\.self_attn\.grep_a$", r"encoder.layers.\1.attention.gru_rel_pos_const"),
    (r"^encoder\.layers\.(\d+)\.self_attn\.grep_linear\.", r"encoder.layers.\1.attention.gru_rel_pos_linear."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.relative_attention_bias\.", r"encoder.layers.\1.attention.rel_attn_embed."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.", r"encoder.layers.\1.attention."),
    (r"^encoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"encoder.layers.\1.layer_norm."),
    (r"^encoder\.layers\.(\d+)\.fc1\.", r"encoder.layers.\1.feed_forward.intermediate_dense."),
    (r"^encoder\.layers\.(\d+)\.fc2\.", r"encoder.layers.\1.feed_forward.output_dense."),
    (r"^mask_emb$", "masked_spec_embed"),
)


def wavlm_key(original: str) -> str:
    """An original WavLM parameter name (after "wavlm_model.") → transformers' WavLMModel's."""
    for pattern, repl in RENAMES:
        new, n = re.subn(pattern, repl, original)
        if n:
            return new
    return original  # encoder.layer_norm, encoder.layers.N.final_layer_norm: the same name


def wavlm_base_plus_config():
    """transformers' WavLMConfig of the encoder Audiobox Aesthetics fixes (WavLM Base+: 12 layers of
    768, 12 heads, the 7-layer conv front end with group norm, 128-wide grouped positional conv,
    gated relative position bias in 320 buckets up to 800)."""
    from transformers import WavLMConfig

    return WavLMConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       hidden_act="gelu", feat_extract_norm="group", feat_extract_activation="gelu",
                       conv_dim=(512,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
                       conv_bias=False, num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16,
                       num_buckets=320, max_bucket_distance=800, do_stable_layer_norm=False, layer_norm_eps=1e-5,
                       hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                       layerdrop=0.0, apply_spec_augment=False)


def split_state(state: dict) -> tuple[dict, dict, dict]:
    """The released state dict → (WavLMModel's state, each axis' MLP state, each axis' layer weights)."""
    wavlm, heads, layer_weights = {}, {a: {} for a in AXES}, {}
    for k, v in state.items():
        k = re.sub(r"^model\.", "", k)  # a training checkpoint's prefix
        if k.startswith("wavlm_model."):
            wavlm[wavlm_key(k[len("wavlm_model."):])] = v
        elif k.startswith("proj_layer."):
            axis, rest = k[len("proj_layer."):].split(".", 1)
            heads[axis][rest] = v
        elif k.startswith("layer_weights."):
            layer_weights[k[len("layer_weights."):]] = v
    return wavlm, heads, layer_weights
