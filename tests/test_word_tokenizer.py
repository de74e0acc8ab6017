"""The miniature's CLIP tokenizer: one token per vocabulary word, any ASCII text still tokenizes,
and the files are the same on every build (pretraining is reproducible from its seed)."""

from transformers import CLIPTokenizer

from pixrl.models.mini.build import shapes_vocabulary
from pixrl.models.mini.tokenizer import write_word_tokenizer


def test_every_vocabulary_word_is_one_token_and_other_text_still_tokenizes(tmp_path):
    words = shapes_vocabulary()
    tok = write_word_tokenizer(words, tmp_path / "tok", max_length=16)
    assert isinstance(tok, CLIPTokenizer)
    for w in words:
        ids = tok(w)["input_ids"]
        assert len(ids) == 3, (w, tok.convert_ids_to_tokens(ids))
        assert tok.convert_ids_to_tokens(ids[1]) == w + "</w>"
    ids = tok("a purple hexagon")["input_ids"]
    assert len(ids) > 5 and tok.unk_token_id not in ids[1:-1]
    assert tok.decode(ids, skip_special_tokens=True) == "a purple hexagon"


def test_builds_are_byte_identical(tmp_path):
    """tokenizers' BpeTrainer broke ties in a per-process hash order; two builds then differed."""
    words = shapes_vocabulary()
    files = []
    for name in ("one", "two"):
        write_word_tokenizer(list(reversed(words)) if name == "two" else words, tmp_path / name, max_length=16)
        files.append({p.name: p.read_bytes() for p in (tmp_path / name).iterdir()})
    assert files[0] == files[1]
