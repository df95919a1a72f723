"""`crag index` over Word, PowerPoint and CSV / TSV files, read through LangChain document loaders.
Each file is written here with the library a user's tools would use (python-docx, python-pptx, csv)."""

from __future__ import annotations

import csv

import pytest

from crag.cli import main
from crag.config import IndexingConfig
from crag.errors import InputError
from crag.indexing import chunk_documents, read_documents
from tests.support import LOCAL_CONF

pytest.importorskip("langchain_community")
docx = pytest.importorskip("docx")
pptx = pytest.importorskip("pptx")


def write_docx(path, paragraphs):
    document = docx.Document()
    document.add_heading("Filter care", level=1)
    for text in paragraphs:
        document.add_paragraph(text)
    document.save(path)
    return path


def write_pptx(path, slides, title=None):
    deck = pptx.Presentation()
    if title:
        deck.core_properties.title = title
    for heading, bullets, notes in slides:
        slide = deck.slides.add_slide(deck.slide_layouts[1])  # title and content
        slide.shapes.title.text = heading
        body = slide.placeholders[1].text_frame
        body.text = bullets[0]
        for bullet in bullets[1:]:
            body.add_paragraph().text = bullet
        if notes:
            slide.notes_slide.notes_text_frame.text = notes
    table_slide = deck.slides.add_slide(deck.slide_layouts[5])  # title only
    table_slide.shapes.title.text = "Modes"
    from pptx.util import Inches

    table = table_slide.shapes.add_table(2, 2, Inches(1), Inches(2), Inches(6), Inches(1)).table
    for r, row in enumerate([["mode", "decibels"], ["sleep", "24"]]):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    deck.save(path)
    return path


def write_csv(path, rows, delimiter=","):
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f, delimiter=delimiter).writerows(rows)
    return path


def test_docx_paragraphs_become_the_document_text(tmp_path):
    file = write_docx(
        tmp_path / "filter_care.docx",
        ["Replace the HEPA-13 main filter every twelve months.", "フィルターは十二か月ごとに交換してください。"],
    )
    [doc] = read_documents(file)
    assert doc.doc_id == "filter_care" and doc.title == "filter care" and doc.source_path == str(file)
    assert doc.text.split("\n\n") == [
        "Filter care",
        "Replace the HEPA-13 main filter every twelve months.",
        "フィルターは十二か月ごとに交換してください。",
    ]


def test_pptx_slides_become_sections_with_notes_and_tables(tmp_path):
    file = write_pptx(
        tmp_path / "deck.pptx",
        [
            ("Filter care", ["Replace the main filter yearly", "Vacuum the pre-filter"], "Speaker note: HEPA-13 only"),
            ("保証", ["保証期間は三年間です"], None),
        ],
        title="AQ-7 training",
    )
    [doc] = read_documents(file)
    assert doc.title == "AQ-7 training" and doc.markdown
    assert doc.text == (
        "## Filter care\n\nReplace the main filter yearly\n\nVacuum the pre-filter\n\nSpeaker note: HEPA-13 only"
        "\n\n## 保証\n\n保証期間は三年間です\n\n## Modes\n\nmode | decibels\n\nsleep | 24"
    )
    # Each slide is its own parent chunk.
    chunks = chunk_documents(file, IndexingConfig())
    parents = sorted(set(chunks.column("parent_text").to_pylist()))
    assert len(parents) == 3 and any(p.startswith("## 保証") for p in parents)


def test_pptx_without_a_title_uses_its_first_slide(tmp_path):
    [doc] = read_documents(write_pptx(tmp_path / "untitled.pptx", [("Noise levels", ["24 dB in sleep mode"], None)]))
    assert doc.title == "Noise levels"


def test_csv_rows_become_documents_with_their_field_columns(tmp_path):
    file = write_csv(
        tmp_path / "faq.csv",
        [
            ["doc_id", "title", "question", "answer", "url"],
            [
                "faq-1",
                "Filter",
                "How often do I replace the filter?",
                "Every twelve months, or sooner.",
                "https://example.test/1",
            ],
            ["", "", "", "", ""],
            ["", "保証", "保証期間は？", "三年間です。", ""],
        ],
    )
    docs = list(read_documents(file))
    assert [d.doc_id for d in docs] == ["faq-1", "faq/row-3"]  # the empty row is skipped, row numbers kept
    assert [d.title for d in docs] == ["Filter", "保証"]
    assert docs[0].url == "https://example.test/1" and docs[1].url is None
    assert docs[0].text == "question: How often do I replace the filter?\nanswer: Every twelve months, or sooner."


def test_a_bad_or_duplicate_doc_id_in_a_table_names_its_rows(tmp_path):
    file = write_csv(tmp_path / "faq.csv", [["doc_id", "answer"], ["a", "one"], ["b", "two"], ["a", "three"]])
    assert [d.where for d in read_documents(file)] == [f"{file}, row {n}" for n in (1, 2, 3)]
    with pytest.raises(InputError) as raised:
        chunk_documents(file, IndexingConfig())
    assert str(raised.value) == f"duplicate doc_id 'a': in {file}, row 1 and in {file}, row 3"
    write_csv(file, [["doc_id", "answer"], ["a", "one"], ["b ", "two"]])
    with pytest.raises(InputError) as raised:
        chunk_documents(file, IndexingConfig())
    assert str(raised.value) == f"{file}, row 2: doc_id 'b ' has spaces around it"


def test_tsv_without_field_columns(tmp_path):
    file = write_csv(
        tmp_path / "modes.tsv", [["mode", "decibels"], ["sleep", "24"], ["turbo, max", "52"]], delimiter="\t"
    )
    docs = list(read_documents(file))
    assert [(d.doc_id, d.title, d.text) for d in docs] == [
        ("modes/row-1", "modes, row 1", "mode: sleep\ndecibels: 24"),
        ("modes/row-2", "modes, row 2", "mode: turbo, max\ndecibels: 52"),
    ]


def test_a_byte_order_mark_and_ragged_rows(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark; a short row lacks cells, a long one has more."""
    file = tmp_path / "bom.csv"
    file.write_bytes("doc_id,title,body\nd1,First,the widget spins,about turbines\nd2,Second\n".encode("utf-8-sig"))
    docs = list(read_documents(file))
    assert [(d.doc_id, d.title) for d in docs] == [("d1", "First")]  # d2 has no text: skipped like an empty row
    assert docs[0].text == "body: the widget spins\nmore: about turbines"
    # a column of that name keeps its cell; the extra cells go under another name
    file.write_text("doc_id,text,more\n1,hello world,real value,extra cell\n", encoding="utf-8")
    assert [d.text for d in read_documents(file)] == ["text: hello world\nmore: real value\n_more: extra cell"]


def test_markdown_and_jsonl_with_a_byte_order_mark(tmp_path):
    (tmp_path / "bom.md").write_bytes("# Real Title\n\nText.\n".encode("utf-8-sig"))
    (tmp_path / "bom.jsonl").write_bytes('{"doc_id": "j", "text": "from jsonl"}\n'.encode("utf-8-sig"))
    assert [d.title for d in read_documents(tmp_path / "bom.md")] == ["Real Title"]
    assert [d.doc_id for d in read_documents(tmp_path / "bom.jsonl")] == ["j"]


def test_a_folder_mixes_every_format(tmp_path):
    (tmp_path / "kb" / "sub").mkdir(parents=True)
    (tmp_path / "kb" / "intro.md").write_text("# Intro\n\nThe AQ-7 purifier.", encoding="utf-8")
    write_docx(tmp_path / "kb" / "sub" / "care.docx", ["Replace the filter yearly."])
    write_pptx(tmp_path / "kb" / "deck.pptx", [("Noise", ["24 dB"], None)])
    write_csv(tmp_path / "kb" / "faq.csv", [["question", "answer"], ["Warranty?", "Three years."]])
    (tmp_path / "kb" / "image.png").write_bytes(b"\x89PNG")  # not a document: ignored in a folder
    ids = [d.doc_id for d in read_documents(tmp_path / "kb")]
    assert ids == ["deck", "faq/row-1", "intro", "sub/care"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("broken.docx", b"not a zip", "cannot read as Word .docx"),
        ("broken.pptx", b"not a zip", "cannot read as PowerPoint"),
        ("latin1.csv", "name\ncaf\xe9\n".encode("latin-1"), "not valid UTF-8"),
        ("empty.csv", b"", "empty file"),
        (
            "sheet.xlsx",
            b"x",
            "unsupported documents file .*expected .jsonl, .md, .txt, .html, .pdf, .docx, .pptx, .csv or .tsv",
        ),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, name, content, message):
    file = tmp_path / name
    file.write_bytes(content)
    with pytest.raises(InputError, match=message) as err:
        list(read_documents(file))
    assert "\n" not in str(err.value)


def test_crag_index_reads_them_from_the_command_line(tmp_path, capsys):
    write_docx(tmp_path / "care.docx", ["Replace the HEPA-13 main filter every twelve months."])
    write_csv(tmp_path / "faq.csv", [["question", "answer"], ["Warranty?", "Three years."]])

    def index(docs) -> int:
        return main(["index", "--conf", str(LOCAL_CONF), "--docs", str(docs), "--out", str(tmp_path / "index")])

    assert index(tmp_path) == 0
    assert "indexed 2 documents" in capsys.readouterr().out
    assert index(tmp_path / "care.docx.missing.pptx") == 2
    assert capsys.readouterr().err.startswith("crag: error: documents not found")


def test_without_the_extra_the_error_names_it(tmp_path, monkeypatch):
    import crag.document_loaders as loaders

    monkeypatch.setattr(loaders, "_community", lambda: None)  # as when langchain-community is not installed
    file = write_docx(tmp_path / "care.docx", ["text"])
    with pytest.raises(
        InputError, match=r"care.docx: reading .docx files needs langchain-community: pip install 'crag\[langchain\]'"
    ):
        list(read_documents(file))
