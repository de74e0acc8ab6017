"""HPSv2 from a released-style checkpoint: a tiny random CLIP written in open_clip's own module
layout (conv1/class_embedding/ln_pre, resblocks with a packed in_proj MultiheadAttention, c_fc/
c_proj MLPs, ln_final/text_projection) and saved as HPSv2 saves it ({"state_dict": …} in a .pt).
The reward's transformers CLIPModel must give the cosine that open_clip's forward, written out
independently here, gives; scores are finite, in range, repeatable and batch-invariant; bad paths
fail before any work, naming the setting."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.compose import RewardSet

W, LAYERS, HEADS, PATCH, IMAGE, CTX, EMBED = 32, 2, 2, 8, 32, 77, 24


class _Block(nn.Module):
    """open_clip's ResidualAttentionBlock (pre-LN, GELU MLP)."""

    def __init__(self, width: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, HEADS, batch_first=True)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, 4 * width)), ("gelu", nn.GELU()),
                                              ("c_proj", nn.Linear(4 * width, width))]))

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Tower(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.resblocks = nn.ModuleList(_Block(width) for _ in range(LAYERS))

    def forward(self, x, mask=None):
        for b in self.resblocks:
            x = b(x, mask)
        return x


class _Visual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, W, PATCH, PATCH, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(W) * 0.1)
        self.positional_embedding = nn.Parameter(torch.randn((IMAGE // PATCH) ** 2 + 1, W) * 0.1)
        self.ln_pre, self.ln_post = nn.LayerNorm(W), nn.LayerNorm(W)
        self.transformer = _Tower(W)
        self.proj = nn.Parameter(torch.randn(W, EMBED) * W ** -0.5)

    def forward(self, pixels):
        x = self.conv1(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(len(x), 1, -1), x], dim=1) + self.positional_embedding
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x[:, 0]) @ self.proj


class _OpenClip(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.visual = _Visual()
        self.token_embedding = nn.Embedding(vocab, W)
        self.positional_embedding = nn.Parameter(torch.randn(CTX, W) * 0.1)
        self.transformer = _Tower(W)
        self.ln_final = nn.LayerNorm(W)
        self.text_projection = nn.Parameter(torch.randn(W, EMBED) * W ** -0.5)
        self.logit_scale = nn.Parameter(torch.tensor(np.log(1 / 0.07), dtype=torch.float32))

    def encode_text(self, tokens, eot_positions):
        """Tokens padded to the context length; pooled at the end-of-text token (open_clip's
        argmax over ids finds it, the end token having the largest id in its vocabulary)."""
        x = self.token_embedding(tokens) + self.positional_embedding
        causal = torch.full((CTX, CTX), float("-inf")).triu(1)
        x = self.ln_final(self.transformer(x, causal))
        return x[torch.arange(len(x)), eot_positions] @ self.text_projection


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(HPS_v2.1_compressed.pt, the processor directory, the open_clip module it holds)."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    from pixrl.models.tiny_parts import clip_tokenizer

    out = tmp_path_factory.mktemp("hps")
    tok = clip_tokenizer(out / "tok")
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE},
                                                     crop_size={"height": IMAGE, "width": IMAGE}),
                  tokenizer=tok).save_pretrained(str(out / "processor"))
    torch.manual_seed(0)
    model = _OpenClip(len(tok)).eval()
    with torch.no_grad():  # LayerNorms away from identity, so a swapped or missing one shows
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, str(out / "HPS_v2.1_compressed.pt"))
    return out / "HPS_v2.1_compressed.pt", out / "processor", model


def _options(released, **kw):
    ckpt, proc, _ = released
    return {"path": str(ckpt), "processor": str(proc), "vision_heads": HEADS, "text_heads": HEADS, **kw}


PROMPTS = ["a red circle", "two blue squares", "a photo of a cat", "a sign that says hello"]


def _images(n=4, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 40, 48, 3), dtype=np.uint8)


def test_hpsv2_is_open_clips_cosine(released):
    from transformers import CLIPProcessor

    _, proc_dir, model = released
    rs = RewardSet({"hpsv2": 1.0}, {"hpsv2": _options(released, batch_size=3)})
    imgs = _images()
    got = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["hpsv2"]
    proc = CLIPProcessor.from_pretrained(str(proc_dir))
    tok = proc.tokenizer(PROMPTS, padding="max_length", max_length=CTX, truncation=True, return_tensors="pt")
    eot = (tok["input_ids"] == proc.tokenizer.eos_token_id).int().argmax(1)
    with torch.no_grad():
        img = model.visual(proc(images=list(imgs), return_tensors="pt")["pixel_values"])
        txt = model.encode_text(tok["input_ids"], eot)
    ref = torch.nn.functional.cosine_similarity(img, txt).numpy()
    assert got.shape == (4,) and np.isfinite(got).all() and (np.abs(got) <= 1).all()
    assert np.allclose(got, ref, atol=1e-5), (got, ref)
    assert np.std(got) > 1e-3  # the prompts and images are told apart


def test_hpsv2_is_repeatable_and_batch_invariant(released):
    rs = RewardSet({"hpsv2": 1.0}, {"hpsv2": _options(released)})
    imgs = _images(seed=1)
    all_at_once = rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["hpsv2"]
    one_by_one = np.concatenate([rs.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}], ["x"])["hpsv2"] for i in range(4)])
    assert np.allclose(one_by_one, all_at_once, atol=1e-5)
    assert np.array_equal(rs.score(imgs, PROMPTS, [{}] * 4, list("abcd"))["hpsv2"], all_at_once)


def test_bad_paths_and_checkpoints_are_named(released, tmp_path):
    ckpt, proc, _ = released
    with pytest.raises(ValueError, match="reward.options.hpsv2.path"):
        build_reward("hpsv2", path=str(tmp_path / "missing.pt"), processor=str(proc))
    with pytest.raises(ValueError, match="reward.options.hpsv2.processor"):
        build_reward("hpsv2", path=str(ckpt), processor=str(tmp_path))
    torch.save({"state_dict": {"fc.weight": torch.zeros(2, 2)}}, str(tmp_path / "other.pt"))
    r = build_reward("hpsv2", path=str(tmp_path / "other.pt"), processor=str(proc))
    with pytest.raises(ScoringError, match="not an open_clip CLIP checkpoint"):
        r.ensure_setup("cpu")
    r = build_reward("hpsv2", **{**_options(released), "vision_heads": 3})  # 32 is not divisible by 3
    with pytest.raises(ScoringError, match="hpsv2"):
        r.ensure_setup("cpu")
