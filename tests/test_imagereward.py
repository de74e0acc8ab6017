"""ImageReward from a released-style checkpoint: a tiny random model written in the upstream
module layout (BLIP's timm ViT — patch_embed/cls_token/pos_embed, blocks with a packed qkv,
norm — and BLIP's med BERT with a cross-attention block per layer, then the MLP head), saved as
ImageReward.pt beside a med_config.json, with a tiny bert-style tokenizer. The reward's
transformers BLIP must give the score this independent forward gives; scores are finite,
repeatable and batch-invariant; bad paths and mismatched parts fail, naming the setting."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.compose import RewardSet

VW, VLAYERS, VHEADS, PATCH, IMAGE = 32, 2, 2, 8, 32
TW, TLAYERS, THEADS, MAXLEN = 24, 2, 2, 35
WORDS = "a red circle two blue squares photo of cat sign that says hello green".split()
PROMPTS = ["a red circle", "two blue squares", "a photo of a cat", "a sign that says hello"]
MEAN, STD = 0.16717362830052426, 1.0333394966054072


class _VitAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(VW, 3 * VW), nn.Linear(VW, VW)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, VHEADS, c // VHEADS).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-2, -1)) * (c // VHEADS) ** -0.5).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class _VitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(VW, eps=1e-6), nn.LayerNorm(VW, eps=1e-6)
        self.attn = _VitAttention()
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(VW, 4 * VW), nn.Linear(4 * VW, VW)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp.fc2(nn.functional.gelu(self.mlp.fc1(self.norm2(x))))


class _Vit(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, VW, PATCH, PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, VW) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, VW) * 0.1)
        self.blocks = nn.ModuleList(_VitBlock() for _ in range(VLAYERS))
        self.norm = nn.LayerNorm(VW, eps=1e-6)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class _BertAttention(nn.Module):
    """med's BertAttention: `self` (query/key/value) and `output` (dense + residual LayerNorm)."""

    def __init__(self, kv_width):
        super().__init__()
        self.self = nn.Module()
        self.self.query, self.self.key, self.self.value = nn.Linear(TW, TW), nn.Linear(kv_width, TW), nn.Linear(kv_width, TW)
        self.output = nn.Module()
        self.output.dense, self.output.LayerNorm = nn.Linear(TW, TW), nn.LayerNorm(TW, eps=1e-12)

    def forward(self, x, kv, additive_mask):
        def heads(t):
            return t.view(t.shape[0], t.shape[1], THEADS, TW // THEADS).transpose(1, 2)

        q, k, v = heads(self.self.query(x)), heads(self.self.key(kv)), heads(self.self.value(kv))
        a = (q @ k.transpose(-1, -2) / (TW // THEADS) ** 0.5 + additive_mask).softmax(-1)
        ctx = (a @ v).transpose(1, 2).reshape(x.shape)
        return self.output.LayerNorm(self.output.dense(ctx) + x)


class _BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.crossattention = _BertAttention(TW), _BertAttention(VW)
        self.intermediate, self.output = nn.Module(), nn.Module()
        self.intermediate.dense = nn.Linear(TW, 2 * TW)
        self.output.dense, self.output.LayerNorm = nn.Linear(2 * TW, TW), nn.LayerNorm(TW, eps=1e-12)

    def forward(self, x, mask, image):
        x = self.attention(x, x, mask)
        x = self.crossattention(x, image, torch.zeros(()))
        return self.output.LayerNorm(self.output.dense(nn.functional.gelu(self.intermediate.dense(x))) + x)


class _Bert(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(vocab, TW, padding_idx=0)
        self.embeddings.position_embeddings = nn.Embedding(MAXLEN + 5, TW)
        self.embeddings.LayerNorm = nn.LayerNorm(TW, eps=1e-12)
        self.embeddings.register_buffer("position_ids", torch.arange(MAXLEN + 5)[None])  # saved, as med saves it
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_BertLayer() for _ in range(TLAYERS))

    def forward(self, ids, attention_mask, image):
        e = self.embeddings
        x = e.LayerNorm(e.word_embeddings(ids) + e.position_embeddings(torch.arange(ids.shape[1])))
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in self.encoder.layer:
            x = layer(x, mask, image)
        return x


class _ImageRewardRef(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.blip = nn.Module()
        self.blip.visual_encoder, self.blip.text_encoder = _Vit(), _Bert(vocab)
        self.blip.vision_proj, self.blip.text_proj = nn.Linear(VW, 8), nn.Linear(TW, 8)  # in the release, unused
        self.mlp = nn.Module()
        self.mlp.layers = nn.Sequential(nn.Linear(TW, 64), nn.Dropout(0.2), nn.Linear(64, 16), nn.Dropout(0.2),
                                        nn.Linear(16, 8), nn.Dropout(0.1), nn.Linear(8, 4), nn.Linear(4, 1))

    def forward(self, pixels, ids, mask):
        txt = self.blip.text_encoder(ids, mask, self.blip.visual_encoder(pixels))
        return ((self.mlp.layers(txt[:, 0]) - MEAN) / STD)[:, 0]


def _reference_pixels(image):
    """torchvision's Resize(IMAGE, BICUBIC) + CenterCrop + ToTensor + Normalize on a PIL image."""
    pil = Image.fromarray(image)
    w, h = pil.size
    nw, nh = (IMAGE, int(IMAGE * h / w)) if w <= h else (int(IMAGE * w / h), IMAGE)
    pil = pil.resize((nw, nh), Image.BICUBIC)
    top, left = int(round((nh - IMAGE) / 2.0)), int(round((nw - IMAGE) / 2.0))
    x = np.asarray(pil.crop((left, top, left + IMAGE, top + IMAGE)), np.float32) / 255.0
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    return torch.from_numpy(((x - mean) / std).transpose(2, 0, 1).astype(np.float32))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(ImageReward.pt with med_config.json beside it, the tokenizer directory, the reference module)."""
    from transformers import BertTokenizer

    out = tmp_path_factory.mktemp("imagereward")
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS)}
    BertTokenizer(vocab=vocab).save_pretrained(str(out / "bert-base-uncased"))
    n_vocab = len(vocab) + 2  # BLIP adds [DEC] and [ENC]
    json.dump({"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
               "hidden_dropout_prob": 0.1, "hidden_size": TW, "initializer_range": 0.02, "intermediate_size": 2 * TW,
               "layer_norm_eps": 1e-12, "max_position_embeddings": MAXLEN + 5, "model_type": "bert",
               "num_attention_heads": THEADS, "num_hidden_layers": TLAYERS, "pad_token_id": 0, "type_vocab_size": 2,
               "vocab_size": n_vocab, "encoder_width": 768, "add_cross_attention": True},
              open(out / "med_config.json", "w"))
    torch.manual_seed(0)
    model = _ImageRewardRef(n_vocab).eval()
    with torch.no_grad():  # LayerNorms away from identity, so a swapped or missing one shows
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
        for m in model.mlp.layers:
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, 0.5)
    torch.save(model.state_dict(), str(out / "ImageReward.pt"))  # as the release: a plain state dict
    return out / "ImageReward.pt", out / "bert-base-uncased", model


def _options(released, **kw):
    ckpt, tok, _ = released
    return {"path": str(ckpt), "tokenizer": str(tok), "vision_heads": VHEADS, **kw}


def _images(n=4, seed=0, shape=(40, 47)):
    return np.random.default_rng(seed).integers(0, 256, (n, *shape, 3), dtype=np.uint8)


@pytest.mark.parametrize("shape", [(40, 47), (47, 40), (IMAGE, IMAGE)])
def test_imagereward_equals_the_upstream_forward(released, shape):
    from transformers import BertTokenizer

    _, tok_dir, model = released
    rs = RewardSet({"imagereward": 1.0}, {"imagereward": _options(released, batch_size=3)})
    imgs = _images(shape=shape)
    got = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["imagereward"]
    tok = BertTokenizer.from_pretrained(str(tok_dir))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    t = tok(PROMPTS, padding="max_length", truncation=True, max_length=MAXLEN, return_tensors="pt")
    assert (t["input_ids"][:, 0] == tok.cls_token_id).all()  # the state scored is [CLS]'s, as upstream
    with torch.no_grad():
        ref = model(torch.stack([_reference_pixels(im) for im in imgs]), t["input_ids"], t["attention_mask"]).numpy()
    assert got.shape == (4,) and got.dtype == np.float32 and np.isfinite(got).all()
    assert np.allclose(got, ref, atol=1e-5, rtol=1e-5), (got, ref)
    assert np.std(got) > 1e-3  # images and prompts are told apart


def test_imagereward_is_repeatable_and_batch_invariant(released):
    rs = RewardSet({"imagereward": 1.0}, {"imagereward": _options(released)})
    imgs = _images(seed=1)
    all_at_once = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["imagereward"]
    one_by_one = np.concatenate([rs.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}], ["x"])["imagereward"]
                                 for i in range(4)])
    assert np.allclose(one_by_one, all_at_once, atol=1e-5)
    assert np.array_equal(rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["imagereward"], all_at_once)


def test_bad_paths_and_mismatched_parts_are_named(released, tmp_path):
    from transformers import BertTokenizer

    ckpt, tok, _ = released
    with pytest.raises(ValueError, match="reward.options.imagereward.path"):
        build_reward("imagereward", path=str(tmp_path / "missing.pt"), tokenizer=str(tok))
    with pytest.raises(ValueError, match="reward.options.imagereward.tokenizer"):
        build_reward("imagereward", path=str(ckpt), tokenizer=str(tmp_path))
    torch.save({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "ImageReward.pt"))
    with pytest.raises(ValueError, match="med_config.json"):  # no med_config.json beside this one
        build_reward("imagereward", path=str(tmp_path / "ImageReward.pt"), tokenizer=str(tok))
    (tmp_path / "med_config.json").write_text(ckpt.with_name("med_config.json").read_text())
    r = build_reward("imagereward", path=str(tmp_path / "ImageReward.pt"), tokenizer=str(tok))
    with pytest.raises(ScoringError, match="not an ImageReward checkpoint"):
        r.ensure_setup("cpu")
    BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "x"])}
                  ).save_pretrained(str(tmp_path / "other_tok"))
    r = build_reward("imagereward", **{**_options(released), "tokenizer": str(tmp_path / "other_tok")})
    with pytest.raises(ScoringError, match="bert-base-uncased"):
        r.ensure_setup("cpu")


def test_the_differentiable_path_is_the_score_refl_trains_through(released):
    """`pixel_scores` — ReFL's score_gard on tensor Resize/CenterCrop/Normalize — equals the score of
    an image at the model's size, and carries a gradient to the pixels at another size."""
    reward = RewardSet({"imagereward": 1.0}, {"imagereward": _options(released)}).rewards["imagereward"]
    reward.ensure_setup("cpu")
    imgs = _images(shape=(IMAGE, IMAGE))
    want = reward.score(imgs, PROMPTS, [{}] * 4)["imagereward"]
    pixels = torch.from_numpy(imgs).permute(0, 3, 1, 2).float().div(255).requires_grad_(True)
    got = reward.pixel_scores(pixels, PROMPTS)
    assert np.allclose(got.detach().numpy(), want, atol=1e-5), (got, want)
    other = torch.from_numpy(_images()).permute(0, 3, 1, 2).float().div(255).requires_grad_(True)
    moved = reward.pixel_scores(other, PROMPTS)
    moved.sum().backward()
    assert torch.isfinite(moved).all() and other.grad.abs().sum() > 0
    near = reward.score(_images(), PROMPTS, [{}] * 4)["imagereward"]  # PIL's bicubic vs torch's antialiased one
    assert np.corrcoef(moved.detach().numpy(), near)[0, 1] > 0.9


def test_the_tiny_writer_writes_the_release_layout(tmp_path):
    """`pixrl tiny-reward imagereward` (what ReFL's default reward runs on without weights): its
    ImageReward.pt loads into the upstream-layout module above, and the reward scores as it does."""
    from transformers import BertTokenizer

    from pixrl.rewards.tiny import write_tiny_reward

    options = write_tiny_reward("imagereward", tmp_path / "ir", seed=1)
    sd = torch.load(options["path"], weights_only=True)
    tok = BertTokenizer.from_pretrained(options["tokenizer"])
    ref = _ImageRewardRef(len(tok) + 2).eval()
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) == {"blip.vision_proj.weight", "blip.vision_proj.bias",
                                               "blip.text_proj.weight", "blip.text_proj.bias",
                                               "blip.text_encoder.embeddings.position_ids"}
    imgs = _images(shape=(IMAGE, IMAGE))
    got = RewardSet({"imagereward": 1.0}, {"imagereward": options}).score(imgs, PROMPTS, [{}] * 4, list("abcd"))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    t = tok(PROMPTS, padding="max_length", truncation=True, max_length=MAXLEN, return_tensors="pt")
    with torch.no_grad():
        want = ref(torch.stack([_reference_pixels(im) for im in imgs]), t["input_ids"], t["attention_mask"]).numpy()
    assert np.allclose(got["imagereward"], want, atol=1e-4) and np.std(want) > 1e-3
