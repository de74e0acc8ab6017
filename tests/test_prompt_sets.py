"""Prompt sets users bring, in every supported format: text lines (OCR prompts with quotes),
GenEval-style JSON lines (metadata kept, "tag" as category), parquet and a Lance dataset — and
errors that name the file and line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pixrl.datasets.prompts import PromptSetError, load_prompt_set, select_categories

GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
]


def test_text_lines_and_geneval_json_lines(tmp_path):
    txt = tmp_path / "ocr.txt"
    txt.write_text('a neon sign that says "OPEN"\n\n  a poster reading “Cat 2025”  \n')
    items = load_prompt_set(txt)
    assert [it.prompt for it in items] == ['a neon sign that says "OPEN"', "a poster reading “Cat 2025”"]
    jl = tmp_path / "evaluation_metadata.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in GENEVAL) + "\n")
    items = load_prompt_set(jl)
    assert [it.prompt for it in items] == [r["prompt"] for r in GENEVAL]
    assert items[1].meta["include"] == [{"class": "clock", "count": 2}] and items[1].meta["category"] == "counting"
    assert [it.prompt for it in select_categories(items, ["colors"])] == ["a photo of a red car"]


def test_parquet_and_lance_tables(tmp_path):
    import lance

    t = pa.table({"prompt": ["a cat", "a dog"], "prompt_id": ["c", "d"], "meta": [json.dumps({"category": "x"}), None]})
    pq.write_table(t, tmp_path / "p.parquet")
    lance.write_dataset(t, str(tmp_path / "p.lance"))
    for path in (tmp_path / "p.parquet", tmp_path / "p.lance"):
        items = load_prompt_set(path)
        assert [(it.prompt_id, it.prompt, it.meta) for it in items] == [("c", "a cat", {"category": "x"}), ("d", "a dog", {})]


def test_bad_lines_are_named(tmp_path):
    jl = tmp_path / "bad.jsonl"
    jl.write_text(json.dumps(GENEVAL[0]) + "\n" + '{"tag": "counting", "prompt": \n')
    with pytest.raises(PromptSetError, match=r"bad.jsonl:2: not a JSON object"):
        load_prompt_set(jl)
    jl.write_text(json.dumps(GENEVAL[0]) + "\n" + json.dumps({"tag": "counting", "text": "x"}) + "\n")
    with pytest.raises(PromptSetError, match=r'bad.jsonl:2: each line needs a non-empty "prompt"'):
        load_prompt_set(jl)
    pq.write_table(pa.table({"caption": ["a cat"]}), tmp_path / "c.parquet")
    with pytest.raises(PromptSetError, match="needs a 'prompt' column"):
        load_prompt_set(tmp_path / "c.parquet")
