"""A tiny CLAP in the released layout, for tests and for trying `clap_score` without weights: a
random `ClapModel` (a RoBERTa text tower and an HTSAT audio tower — a Swin over the mel
spectrogram folded into a square — at small widths) saved with its `ClapProcessor`: the feature
extractor at CLAP's 48 kHz with a 2 s window, and a RoBERTa byte-level BPE tokenizer (`<s>`,
`<pad>`, `</s>`, `<unk>`, `<mask>` as RoBERTa numbers them) whose words are the tiny vocabulary's."""

from __future__ import annotations

from pathlib import Path


def roberta_tokenizer(out_dir: Path):
    """RoBERTa's byte-level BPE in miniature: the 256 byte symbols after its four special tokens,
    merges that make each tiny-vocabulary word (with and without its leading space) one token."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import RobertaTokenizer

    from ..models.tiny_parts import tiny_vocabulary, whole_word_merges

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for c in sorted(ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
    words = tiny_vocabulary()
    merges = whole_word_merges(vocab, ["Ġ" + w for w in words] + [w for w in words if len(w) > 1])
    vocab["<mask>"] = len(vocab)
    tok = RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=64)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return RobertaTokenizer.from_pretrained(str(out_dir))


def write_tiny_clap(out_dir: Path, seed: int = 0, fusion: bool = False) -> Path:
    """A random ClapModel + ClapProcessor saved to `out_dir` (returned); `fusion`: the fused
    variant's audio tower (laion/clap-htsat-fused's kind) and feature extractor."""
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    import tempfile

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as d:  # (the processor saves it beside the model)
        tok = roberta_tokenizer(Path(d))
    mels, side = (64, 128) if fusion else (16, 64)  # transformers' fusion crops are 64 mel bins wide
    torch.manual_seed(seed)
    cfg = ClapConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=tok.model_max_length + 2, projection_dim=24),
        audio_config=dict(num_mel_bins=mels, spec_size=side, window_size=4, patch_size=4, patch_stride=(4, 4),
                          patch_embeds_hidden_size=16, hidden_size=32, depths=[1, 1], num_attention_heads=[2, 2],
                          projection_dim=24, enable_fusion=fusion, fusion_type="aff_2d" if fusion else None),
        projection_dim=24)
    ClapModel(cfg).save_pretrained(str(out_dir))
    features = ClapFeatureExtractor(feature_size=mels, sampling_rate=48_000, hop_length=480, max_length_s=2,
                                    fft_window_size=1024, frequency_min=50, frequency_max=14_000,
                                    truncation="fusion" if fusion else "rand_trunc", padding="repeatpad")
    ClapProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(str(out_dir))
    return out_dir
