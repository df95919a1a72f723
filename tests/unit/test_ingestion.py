"""Document ingestion for crag index (each file type) and the Vector Search index build against the
emulator speaking the REST protocol."""

import pytest

from crag.config import IndexingConfig, load_config
from crag.errors import InputError
from crag.indexing import build_knowledge_base, chunk_documents
from tests.support import REPO, SAMPLE, write_pdf


def test_each_file_type(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# Guide\n\n## Filters\n\nReplace the filter every 12 months.\n")
    (docs / "notes.txt").write_text("Warranty: three years from purchase.\n")
    (docs / "page.html").write_text(
        "<html><head><title>Support page</title><script>var x = 'tracking';</script></head><body><nav>Home | About</nav>"
        "<h1>Support</h1><p>Call us from 9:00 to 18:00.</p><h2>Returns</h2><p>Returns within <b>30 days</b>.</p></body></html>"
    )
    write_pdf(docs / "policy.pdf", ["Insurance policy for the AQ-7.", "Water damage is not covered."])
    (docs / "data.jsonl").write_text('{"doc_id": "j1", "title": "J", "text": "from jsonl"}\n')
    rows = chunk_documents(docs, IndexingConfig()).to_pylist()
    by_doc = {}
    for r in rows:
        by_doc.setdefault(r["doc_id"], []).append(r)
    assert set(by_doc) == {"guide", "notes", "page", "policy"}  # a folder holds files; .jsonl is read on its own
    page = by_doc["page"]
    assert page[0]["title"] == "Support page"
    assert [r["parent_text"].splitlines()[0] for r in page] == ["# Support", "## Returns"]  # HTML sections as parents
    assert "tracking" not in " ".join(r["parent_text"] for r in page) and "Home | About" not in page[0]["parent_text"]
    assert "Returns within 30 days." in page[1]["parent_text"]
    policy = by_doc["policy"]
    assert policy[0]["title"] == "Hoshi AQ-7 Policy" and "Water damage is not covered." in policy[0]["parent_text"]
    assert chunk_documents(docs / "data.jsonl", IndexingConfig()).to_pylist()[0]["doc_id"] == "j1"


def test_html_blocks_keep_their_words_apart():
    """Cells, terms, small headings, nested blocks and form labels each end their words: run together
    ("WeightNoise", "ParentChild") no search could find them."""
    from crag.indexing import html_to_markdown
    from crag.text import tokenize

    _, text = html_to_markdown(
        "<h2>Specs</h2><table><tr><th>Weight</th><th>Noise</th></tr><tr><td>5.2 kg</td><td>22 dB</td></tr></table>"
        "<dl><dt>Power</dt><dd>40 W</dd></dl><h4>Deep</h4><p>A <b>bold</b> word and <a href='#'>link</a>s.</p>"
        "<ul><li>Parent<ul><li>Child</li></ul></li></ul><div>Intro<p>Para</p></div>"
        "<details><summary>Filter</summary>HEPA</details><label>Colour</label><select><option>Red</option></select>"
    )
    assert text.splitlines() == [
        *("## Specs", "Weight Noise", "5.2 kg 22 dB", "Power", "40 W", "Deep", "A bold word and links."),
        *("Parent", "Child", "Intro", "Para", "Filter", "HEPA", "Colour", "Red"),
    ]
    assert {"weight", "nois", "power", "deep", "parent", "child", "intro", "filter", "colour"} <= set(tokenize(text))


def test_flat_chunks_of_reference_flow_3(tmp_path):
    (tmp_path / "long.txt").write_text(" ".join(f"Sentence number {i} of the policy." for i in range(200)))
    rows = chunk_documents(
        tmp_path / "long.txt", IndexingConfig(parents="chunk", child_chars=500, child_overlap=50)
    ).to_pylist()
    assert len(rows) > 5 and all(r["parent_text"] == r["chunk_text"] and len(r["chunk_text"]) <= 500 for r in rows)
    assert len({r["parent_id"] for r in rows}) == len(rows)  # every chunk its own document


def test_unreadable_pdf_is_one_clear_error(tmp_path):
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 not really")
    with pytest.raises(InputError, match="broken.pdf: cannot read as PDF"):
        chunk_documents(tmp_path / "broken.pdf", IndexingConfig())


def test_vector_search_index_is_created_then_synced(emulator, tmp_path):
    emulator.vector_indexes = {}
    cfg = load_config(
        REPO / "conf" / "databricks.yaml", ["retriever.embedding_endpoint=my-bge", "retriever.policy.timeout_s=2"]
    )
    manifest = build_knowledge_base(SAMPLE / "kb", tmp_path / "kb", cfg)
    assert manifest["vector_index"] == "created main.crag.chunks_index on endpoint crag-vector-search"
    create = [r for r in emulator.of("vector_search") if r.method == "POST" and r.path.endswith("/indexes")]
    assert len(create) == 1 and create[0].path == "/api/2.0/vector-search/endpoints/crag-vector-search/indexes"
    assert create[0].body == {
        "name": "main.crag.chunks_index",
        "index_type": "DELTA_SYNC",
        "primary_key": "chunk_id",
        "delta_sync_index_spec": {
            "source_table": "main.crag.chunks",
            "pipeline_type": "TRIGGERED",
            "embedding_source_columns": [{"name": "chunk_text", "embedding_model_endpoint_name": "my-bge"}],
        },
    }
    manifest = build_knowledge_base(SAMPLE / "kb", tmp_path / "kb", cfg)
    assert manifest["vector_index"].startswith("synced") and emulator.syncs == ["main.crag.chunks_index"]
    emulator.vector_indexes = None


def test_an_index_created_by_a_request_whose_reply_was_lost_counts_as_created(emulator, tmp_path, monkeypatch):
    """The service creates the index, then its reply fails (a 5xx); the retried creation finds it there
    (409 RESOURCE_ALREADY_EXISTS): the build syncs the index that exists (another build may have made it
    and begun its first sync before this one wrote the chunk table) instead of failing."""
    from crag.emulators import server

    real = server.ROUTES["vector_search"]
    lost: list[str] = []

    def created_then_failed(emulator, method, path, body, fault):
        status, payload = real(emulator, method, path, body, fault)
        if method == "POST" and path.endswith("/indexes") and status == 200 and not lost:
            lost.append(path)  # only the first creation's reply
            return 503, {"error_code": "TEMPORARILY_UNAVAILABLE", "message": "upstream timed out"}
        return status, payload

    monkeypatch.setitem(server.ROUTES, "vector_search", created_then_failed)
    emulator.vector_indexes = {}
    cfg = load_config(
        REPO / "conf" / "databricks.yaml", ["retriever.policy.timeout_s=2", "retriever.policy.backoff_initial_s=0.01"]
    )
    manifest = build_knowledge_base(SAMPLE / "kb", tmp_path / "kb", cfg)
    create = [r for r in emulator.of("vector_search") if r.method == "POST" and r.path.endswith("/indexes")]
    assert len(create) == 2 and manifest["vector_index"].startswith("synced main.crag.chunks_index")
    assert emulator.syncs[-1] == "main.crag.chunks_index"
    emulator.vector_indexes = None
