import json
import re

import pytest

from crag.backends.bm25 import INDEX_VERSION, BM25Retriever, LexicalIndex, OfflineCorpusSearch
from crag.config import IndexingConfig
from crag.errors import InputError, UnusableIndexError
from crag.indexing import build_index, chunk_documents
from crag.tables import read_whole_table
from crag.text import tokenize


def _write_docs(tmp_path):
    docs = tmp_path / "docs"
    (docs / "ja").mkdir(parents=True)
    (docs / "guide.md").write_text(
        "# Guide\n\nIntro paragraph about the device.\n\n## Filters\n\nReplace the filter every 12 months.\n\n"
        "## Noise\n\nTurbo mode reaches 52 dB. " + "More words about noise. " * 40 + "\n"
    )
    (docs / "notes.txt").write_text("Plain text notes about warranty: three years.\n")
    (docs / "ja" / "hoshou.md").write_text("# 保証\n\n保証期間は3年間です。製品登録で5年間に延長されます。\n")
    return docs


def test_markdown_sections_become_parents_and_children_point_to_them(tmp_path):
    chunks = chunk_documents(_write_docs(tmp_path), IndexingConfig(child_chars=200, child_overlap=20))
    rows = chunks.to_pylist()
    guide = [r for r in rows if r["doc_id"] == "guide"]
    parents = {r["parent_id"]: r["parent_text"] for r in guide}
    assert parents["guide#p1"].startswith("## Filters") and "12 months" in parents["guide#p1"]
    assert all(r["title"] == "Guide" for r in guide)
    # the long Noise section has several children, all inside their parent
    noise = [r for r in guide if r["parent_text"].startswith("## Noise")]
    assert len(noise) > 3 and all(r["chunk_text"] in r["parent_text"] for r in noise)
    assert all(len(r["chunk_text"]) <= 200 for r in rows)
    assert {r["doc_id"] for r in rows} == {"guide", "notes", "ja/hoshou"}
    assert [r["title"] for r in rows if r["doc_id"] == "notes"] == ["notes"]


def test_parents_are_capped_by_parent_chars(tmp_path):
    chunks = chunk_documents(_write_docs(tmp_path), IndexingConfig(parent_chars=300, child_chars=100, child_overlap=0))
    assert max(len(t) for t in chunks.column("parent_text").to_pylist()) <= 300


def test_build_index_writes_chunk_table_bm25_and_manifest(tmp_path):
    manifest = build_index(_write_docs(tmp_path), tmp_path / "idx", IndexingConfig())
    assert manifest["version"] == INDEX_VERSION and manifest["n_documents"] == 3
    saved = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert saved["n_chunks"] == read_whole_table(tmp_path / "idx" / saved["data"] / "chunks").num_rows


def test_a_rebuild_switches_whole_builds_and_a_killed_one_changes_nothing(tmp_path):
    """A build is written aside and switched by the manifest: an interrupted build (its folder left
    half-written) leaves the index serving the last complete one; old builds are removed."""
    import os

    from crag.backends.bm25 import LexicalIndex, index_data

    docs = _write_docs(tmp_path)
    first = build_index(docs, tmp_path / "idx", IndexingConfig())
    dead = tmp_path / "idx" / "build-dead"
    (dead / "chunks").mkdir(parents=True)  # what a SIGKILL midway leaves
    os.utime(dead, (0, 0))
    assert LexicalIndex(tmp_path / "idx").data.name == first["data"]
    second = build_index(docs, tmp_path / "idx", IndexingConfig(child_chars=80, child_overlap=0))
    os.utime(tmp_path / "idx" / first["data"], (0, 0))  # long enough ago not to be a build in flight
    third = build_index(docs, tmp_path / "idx", IndexingConfig())
    builds = sorted(p.name for p in (tmp_path / "idx").glob("build-*"))
    assert builds == sorted([second["data"], third["data"]])  # the one before stays for its readers
    assert index_data(tmp_path / "idx").name == third["data"]


def test_an_index_that_disagrees_with_itself_is_named_not_served(tmp_path):
    import shutil

    from crag.backends.bm25 import LexicalIndex, index_data

    docs = _write_docs(tmp_path)
    build_index(docs, tmp_path / "a", IndexingConfig())
    build_index(docs, tmp_path / "b", IndexingConfig(child_chars=80, child_overlap=0))
    data = index_data(tmp_path / "a")
    shutil.rmtree(data / "bm25")
    shutil.copytree(index_data(tmp_path / "b") / "bm25", data / "bm25")  # another build's BM25 index
    with pytest.raises(UnusableIndexError, match="does not agree with itself"):
        LexicalIndex(tmp_path / "a")
    shutil.rmtree(data)
    with pytest.raises(UnusableIndexError, match="missing or incomplete"):
        LexicalIndex(tmp_path / "a")


def test_jsonl_documents_and_their_errors(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text(json.dumps({"doc_id": "a", "title": "A", "text": "alpha text", "url": "https://x/a"}) + "\n\n")
    assert chunk_documents(good, IndexingConfig()).to_pylist()[0]["url"] == "https://x/a"
    cases = {
        b'{"doc_id": "a", "text": ""}\n': "missing or empty string field",
        b'{"doc_id": "a"\n': "not valid JSON",
        b'["a"]\n': "line is not a JSON object \\(got list\\)",
        b'{"doc_id": "a", "text": "caf\xe9"}\n': "not valid UTF-8",
        b'{"doc_id": "a", "text": "x"}\n\n{"doc_id": "a", "text": "y"}\n': r"duplicate doc_id 'a': in \S*bad.jsonl:1 and in \S*bad.jsonl:3$",
        b'{"doc_id": "a", "text": "x", "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}\n": ":1: line is not readable JSON: it is nested too deeply",
        b'{"doc_id": "a", "text": "x", "n": '
        + b"9" * 5000
        + b"}\n": r":1: line is not readable JSON \(Exceeds the limit",
        b'{"doc_id": "a", "text": "x", "url": 5}\n': ":1: url must be a string \\(got int\\)",
        b'{"doc_id": "a\\ud800", "text": "x"}\n': ":1: doc_id is not valid text \\(it holds a lone surrogate",
        b'{"doc_id": "a\\nb", "text": "x"}\n': r"bad.jsonl:1: doc_id 'a\\nb' contains control or invisible character U\+000A at position 1$",
        b'{"doc_id": "a\\u200bb", "text": "x"}\n': r"doc_id 'a\\u200bb' contains control or invisible character U\+200B \(ZERO WIDTH SPACE\)",
        b'{"doc_id": "a ", "text": "x"}\n': r"bad.jsonl:1: doc_id 'a ' has spaces around it$",
    }
    for content, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(content)
        with pytest.raises(InputError, match=message):
            chunk_documents(bad, IndexingConfig())
    with pytest.raises(InputError, match="documents not found"):
        chunk_documents(tmp_path / "nope", IndexingConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no document files under .*: expected .md, .txt, .html, .pdf, .docx"):
        chunk_documents(tmp_path / "empty", IndexingConfig())


def test_documents_with_no_searchable_word_are_one_line_and_leave_the_index_as_it_was(tmp_path):
    from crag.indexing import build_index

    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"doc_id": "a", "text": "alpha text"}) + "\n")
    bad.write_text(
        "".join(
            json.dumps(d) + "\n" for d in ({"doc_id": "a", "text": "the of and"}, {"doc_id": "b", "text": "--- !!!"})
        )
    )
    build_index(good, tmp_path / "index", IndexingConfig())
    before = sorted(p.name for p in (tmp_path / "index").iterdir())
    with pytest.raises(InputError, match="nothing to search in these documents: every chunk is empty once tokenised"):
        build_index(bad, tmp_path / "index", IndexingConfig())
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == before  # no half-built folder beside it


def test_missing_or_incompatible_index_is_a_clear_error(tmp_path):
    from crag.backends.bm25 import index_data

    # the hint is the whole command, config included: the config's indexing section must match the retriever's
    hint = re.escape(f"crag index --conf CONF --docs PATH --out {tmp_path / 'none'}")
    with pytest.raises(UnusableIndexError, match=f"no crag index at .*build one with: {hint}"):
        LexicalIndex(tmp_path / "none")
    with pytest.raises(UnusableIndexError, match=f"no crag index at .*build one with: {hint}"):
        index_data(tmp_path / "none")
    build_index(_write_docs(tmp_path), tmp_path / "idx", IndexingConfig())
    manifest = tmp_path / "idx" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 99}))
    with pytest.raises(
        UnusableIndexError, match="version 99.*rebuild it with crag index --conf CONF --docs PATH --out "
    ):
        LexicalIndex(tmp_path / "idx")
    manifest.write_text("{not json")
    with pytest.raises(UnusableIndexError, match="not valid JSON"):
        LexicalIndex(tmp_path / "idx")


def test_retriever_returns_parents_deduplicated_best_first(sample_indexes):
    retriever = BM25Retriever(sample_indexes["kb"])
    [docs] = retriever.search(["How often should the HEPA-13 main filter be replaced?"], k=10)
    assert 0 < len(docs) <= 10
    assert len({d["parent_id"] for d in docs}) == len(docs)
    assert [d["rank"] for d in docs] == list(range(1, len(docs) + 1))
    scores = [d["retrieval_score"] for d in docs]
    assert scores == sorted(scores, reverse=True)
    assert docs[0]["doc_id"] == "aq7-filters" and "every 12 months" in docs[0]["text"]
    assert all(d["source"] == "internal" for d in docs)


def test_the_top_chunks_are_bm25s_own_scores_best_first_ties_by_position(tmp_path):
    """The top k are chosen by crag, not by bm25s.retrieve (README "Performance"): the same scores as
    bm25s's, over a corpus of repeated passages (every score tied three times), the earlier chunk
    first among equals, and k larger than the chunks that match."""
    passages = ["The Rhine flows to the North Sea.", "Sapporo hosted the 1972 Winter Olympics.", "Rivers flow to seas."]
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(
            json.dumps({"doc_id": f"d{i}-{copy}", "text": text}) + "\n"
            for copy in range(3)
            for i, text in enumerate(passages)
        )
    )
    build_index(docs, tmp_path / "idx", IndexingConfig())
    index = LexicalIndex(tmp_path / "idx")
    queries = ["Where does the Rhine flow?", "Winter Olympics in Sapporo", "flow to the sea"]
    for query, top in zip(queries, index._top_chunks(queries, 4)):
        tokens = [t for t in tokenize(query) if t in index._vocab]
        ids, scores = index._bm25.retrieve([tokens], k=9, show_progress=False)
        expected = sorted(
            ((int(c), float(s)) for c, s in zip(ids[0], scores[0]) if s > 0), key=lambda cs: (-cs[1], cs[0])
        )
        assert top == expected[:4] and top
    [few] = index._top_chunks(["Sapporo"], 8)
    assert [c for c, _ in few] == [1, 4, 7]  # the three copies that match, in corpus order


def test_japanese_question_finds_the_japanese_document(sample_indexes):
    [docs] = BM25Retriever(sample_indexes["kb"]).search(["交換用フィルターの品番は何ですか？"], k=5)
    assert docs[0]["doc_id"] == "ja/aq7-filter-koukan"


def test_query_without_known_terms_returns_nothing(sample_indexes):
    assert BM25Retriever(sample_indexes["kb"]).search(["zzzz qqqq", "???"], k=5) == [[], []]


def test_offline_web_search_returns_k_distinct_pages(sample_indexes):
    search = OfflineCorpusSearch(sample_indexes["web"])
    results = search.search("air cleaners particles ozone", k=3)
    assert len(results) == 3 and len({r["doc_id"] for r in results}) == 3
    assert results[0]["doc_id"] == "web-ozone"
    assert all(r["source"] == "web" and r["url"].startswith("https://") for r in results)
    # pages that share no word with the query are not results, however few match
    assert [r["doc_id"] for r in search.search("Mount Fuji eruption", k=3)] == ["web-fuji"]


def test_a_chunk_table_is_written_whole_elsewhere_and_copied_into_a_new_folder_only(tmp_path):
    """delta-rs cannot commit on FUSE mounts such as Databricks' /Volumes (no hard links, no no-replace
    rename): the table is written in a local temporary folder and its files copied. A copy over an
    existing table would mix two transaction logs, so an existing folder is refused."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from crag.tables import write_table

    table = pa.table({"chunk_id": ["a#c0", "b#c0"], "chunk_text": ["one", "two"]})
    write_table(tmp_path / "chunks", table)
    written = DeltaTable(str(tmp_path / "chunks"))
    assert written.version() == 0 and written.to_pyarrow_table().equals(table)
    with pytest.raises(FileExistsError, match="writes new tables only"):
        write_table(tmp_path / "chunks", table)
    assert DeltaTable(str(tmp_path / "chunks")).version() == 0


def test_an_index_rebuilt_in_its_folder_is_read_again_by_a_process_that_read_it(tmp_path):
    """Spark reuses its Python workers across runs: a worker that loaded an index (and built backends
    on it) must read the new build after `crag index` rebuilt the same folder."""
    from crag.backends import cached_backends
    from crag.config import load_config
    from tests.support import LOCAL_CONF

    docs = tmp_path / "docs.jsonl"

    def build(colour: str) -> None:
        docs.write_text(json.dumps({"doc_id": "w", "text": f"The widget colour is {colour}."}) + "\n")
        build_index(docs, tmp_path / "kb", IndexingConfig())

    cfg = load_config(LOCAL_CONF, [f"retriever.index={tmp_path / 'kb'}", "web_search.backend=none"])

    def found() -> str:
        (docs_found,) = cached_backends(cfg).retriever.search(["widget colour"], 1)
        return docs_found[0]["text"]

    build("red")
    assert found() == "The widget colour is red."
    build("blue")
    assert found() == "The widget colour is blue."


def test_a_folder_says_which_files_it_left_out(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "page.md").write_text("# T\n\nhello world\n")
    (docs / "empty.md").write_text("")
    (docs / "guide.rst").write_text("words")
    (docs / "sub" / "kb.JSONL").write_text('{"doc_id": "a", "text": "b"}\n')
    (docs / "sub" / "x.txt").write_text("hi there")
    (docs / ".DS_Store").write_bytes(b"\0")
    (docs / ".git").mkdir()
    (docs / ".git" / "config").write_text("[core]")
    assert {r["doc_id"] for r in chunk_documents(docs, IndexingConfig()).to_pylist()} == {"page", "sub/x"}
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "crag index: skipped 2 files (guide.rst, sub/kb.JSONL): not a document kind "
        "(a .jsonl file is read on its own: give it as --docs)",
        "crag index: left out 1 document (empty) without text",
    ]


def test_two_files_with_one_doc_id_are_both_named(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# Guide\n\nthe markdown one\n")
    (docs / "guide.txt").write_text("the text one\n")
    with pytest.raises(InputError) as raised:
        chunk_documents(docs, IndexingConfig())
    assert str(raised.value) == (
        f"duplicate doc_id 'guide': in {docs / 'guide.md'} and in {docs / 'guide.txt'} "
        "(a file's doc_id is its path under the documents folder, without its suffix)"
    )


def test_an_out_path_through_a_file_is_said_before_the_documents_are_read(tmp_path, monkeypatch):
    import crag.indexing

    monkeypatch.setattr(crag.indexing, "chunk_documents", lambda *a: pytest.fail("the documents were read"))
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(InputError, match=f"^--out {re.escape(str(out))}: .*afile is a file, not a folder$"):
            build_index(tmp_path, out, IndexingConfig())


def test_an_unreadable_pdf_is_one_line_without_pypdfs_warnings(tmp_path, capsys, caplog):
    (tmp_path / "fake.pdf").write_text("this is not a pdf\n")
    with pytest.raises(InputError, match="fake.pdf: cannot read as PDF"):
        chunk_documents(tmp_path, IndexingConfig())
    assert not [r for r in caplog.records if r.name.startswith("pypdf")] and capsys.readouterr().err == ""


def test_a_damaged_pdf_that_reads_is_indexed_with_one_line_on_its_warnings(tmp_path, capsys):
    import logging

    from tests.support import write_pdf

    pdf = tmp_path / "policy.pdf"
    write_pdf(pdf, ["Water damage is not covered."])
    content = pdf.read_bytes()
    start = content.rindex(b"startxref\n") + len(b"startxref\n")
    pdf.write_bytes(content[:start] + b"9" + content[start:])  # a wrong offset of its cross-reference table
    level = logging.getLogger("pypdf").level
    rows = chunk_documents(tmp_path, IndexingConfig()).to_pylist()
    assert "Water damage is not covered." in rows[0]["parent_text"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"crag index: {pdf}: pypdf read it with "), err
    assert logging.getLogger("pypdf").level == level and logging.getLogger("pypdf").propagate  # as it was
