"""Documents -> parent and child chunks -> chunk table + BM25 index (+ dense vectors) (`crag index`).

Parents are what the generator reads (a Markdown section, or a few paragraphs); children are the small
pieces that search matches, each pointing at its parent — the small/large chunk scheme of reference
flow 1. The same chunk table is the source of a Databricks Vector Search index.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from bs4 import BeautifulSoup
from langchain_text_splitters import MarkdownHeaderTextSplitter, RecursiveCharacterTextSplitter
from pypdf import PdfReader
from pypdf.errors import PdfReadError

from crag import schema, tables
from crag.backends import resolve_credentials
from crag.backends.bm25 import index_data, write_index
from crag.backends.remote import on_databricks
from crag.backends.vector_search import sync_vector_index
from crag.config import CragConfig, IndexingConfig
from crag.document_loaders import LOADER_SUFFIXES, load_file  # formats read through LangChain loaders
from crag.errors import InputError
from crag.ids import forbidden_character
from crag.spark import get_spark
from crag.tables import iter_jsonl
from crag.text import encodable

# Paragraphs first, then lines, then sentence ends (Western and Japanese), then words, then characters.
SEPARATORS = ["\n\n", "\n", "。", ". ", "！", "？", "! ", "? ", "、", ", ", " ", ""]
TEXT_SUFFIXES = {".md", ".markdown", ".txt", ".html", ".htm", ".pdf"}
DOCUMENT_SUFFIXES = TEXT_SUFFIXES | LOADER_SUFFIXES
_KINDS = ".jsonl, .md, .txt, .html, .pdf, .docx, .pptx, .csv or .tsv"


@dataclass(frozen=True)
class SourceDocument:
    doc_id: str
    title: str
    text: str
    url: str | None
    source_path: str
    markdown: bool
    place: str = ""  # where in source_path, for messages: a JSONL line (":12") or a CSV row (", row 3")

    @property
    def where(self) -> str:
        return self.source_path + self.place


def read_documents(path: str | Path) -> Iterator[SourceDocument]:
    """JSONL lines {"doc_id", "title", "text", "url"?}, or files: Markdown, plain text, HTML, PDF, Word,
    PowerPoint, CSV / TSV (one, or a folder searched recursively)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"documents not found: {path}")
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file())
        files = [p for p in found if p.suffix.lower() in DOCUMENT_SUFFIXES]
        if not files:
            raise InputError(f"no document files under {path}: expected {_KINDS.replace('.jsonl, ', '')}")
        # left out, and said so (hidden files and folders aside: .DS_Store, .git/)
        other = [
            p
            for p in found
            if p.suffix.lower() not in DOCUMENT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        if other:
            jsonl = (
                " (a .jsonl file is read on its own: give it as --docs)"
                if any(p.suffix.lower() == ".jsonl" for p in other)
                else ""
            )
            skipped = _named([p.relative_to(path).as_posix() for p in other], "file")
            print(f"crag index: skipped {skipped}: not a document kind{jsonl}", file=sys.stderr)
        for file in files:
            yield from _read_file(file, path)
    elif path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix.lower() in DOCUMENT_SUFFIXES:
        yield from _read_file(path, path.parent)
    else:
        raise InputError(f"unsupported documents file {path}: expected {_KINDS} or a folder of them")


def _named(names: list[str], noun: str, shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} {noun}{'s' if len(names) > 1 else ''} ({', '.join(names[:shown])}{more})"


def _read_jsonl(path: Path) -> Iterator[SourceDocument]:
    for lineno, row in iter_jsonl(path):
        missing = [k for k in ("doc_id", "text") if not isinstance(row.get(k), str) or not row[k].strip()]
        if missing:
            raise InputError(f"{path}:{lineno}: missing or empty string field(s) {', '.join(missing)}")
        for key in ("doc_id", "title", "text", "url"):
            value = row.get(key)
            if value is not None and not isinstance(value, str):
                raise InputError(f"{path}:{lineno}: {key} must be a string (got {type(value).__name__})")
            if value is not None and not encodable(value):
                raise InputError(
                    f"{path}:{lineno}: {key} is not valid text (it holds a lone surrogate, an unpaired \\ud800-\\udfff escape)"
                )
        yield SourceDocument(
            doc_id=row["doc_id"],
            title=str(row.get("title") or row["doc_id"]),
            text=row["text"],
            url=row.get("url"),
            source_path=str(path),
            markdown=False,
            place=f":{lineno}",
        )


def _read_file(file: Path, root: Path) -> Iterator[SourceDocument]:
    if file.suffix.lower() not in LOADER_SUFFIXES:
        yield _read_text_file(file, root)
        return
    for doc in load_file(file, file.relative_to(root).with_suffix("").as_posix()):
        place = f", row {doc.row}" if doc.row is not None else ""
        yield SourceDocument(doc.doc_id, doc.title, doc.text, doc.url, str(file), doc.markdown, place)


def _read_text_file(file: Path, root: Path) -> SourceDocument:
    suffix = file.suffix.lower()
    doc_id = file.relative_to(root).with_suffix("").as_posix()
    if suffix == ".pdf":
        return _read_pdf(file, doc_id)
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark is no part of the text (or its title)
    except UnicodeDecodeError:
        raise InputError(f"{file}: not valid UTF-8") from None
    title = None
    if suffix in {".html", ".htm"}:
        title, text = html_to_markdown(text)
    markdown = suffix in {".md", ".markdown", ".html", ".htm"}
    heading = re.search(r"^#\s+(.+)$", text, re.MULTILINE) if markdown else None
    return SourceDocument(
        doc_id=doc_id,
        title=title or (heading.group(1).strip() if heading else file.stem.replace("_", " ").replace("-", " ")),
        text=text,
        url=None,
        source_path=str(file),
        markdown=markdown,
    )


# Elements that end a line of text (headings h1-h3 become Markdown headings instead)
_HTML_BLOCKS = [
    *("p", "li", "tr", "div", "br", "dt", "dd", "h4", "h5", "h6", "pre", "blockquote", "table", "caption"),
    *("section", "article", "main", "aside", "figure", "figcaption", "address", "ul", "ol", "dl", "hr"),
    *("details", "summary", "fieldset", "legend", "label", "option"),
]


def html_to_markdown(page: str) -> tuple[str | None, str]:
    """(title, text) of an HTML page: scripts, styles and navigation dropped, headings h1-h3 turned
    into Markdown headings so that the page is split into sections like a Markdown file."""
    soup = BeautifulSoup(page, "html.parser")
    for tag in soup(["script", "style", "noscript", "nav", "header", "footer", "template"]):
        tag.decompose()
    title = soup.title.get_text(" ", strip=True) if soup.title else None
    for level in (1, 2, 3):
        for heading in soup.find_all(f"h{level}"):
            heading.replace_with(f"\n\n{'#' * level} {heading.get_text(' ', strip=True)}\n\n")
    for block in soup.find_all(_HTML_BLOCKS):  # a block starts and ends a line, also inside another
        block.insert_before("\n")
        block.insert_after("\n")
    for cell in soup.find_all(["td", "th"]):  # cells of a row: words of their own, on the row's line
        cell.insert_after(" ")
    body = soup.body or soup
    lines = [line.strip() for line in re.sub(r"[ \t]+", " ", body.get_text()).splitlines()]
    # one block per line, a blank line before each heading (blocks nested in blocks gave several)
    text = "\n".join(line for line in lines if line)
    return title, re.sub(r"\n(#{1,3} )", r"\n\n\1", text)


@contextmanager
def _pypdf_warnings() -> Iterator[list[str]]:
    """pypdf's log records while a file is read, kept from the log and collected (the logger's own
    settings restored after)."""
    caught: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    logger, handler = logging.getLogger("pypdf"), Collect(logging.WARNING)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield caught
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _read_pdf(file: Path, doc_id: str) -> SourceDocument:
    with _pypdf_warnings() as warnings:
        try:
            reader = PdfReader(file)
            pages = [page.extract_text() or "" for page in reader.pages]
            title = (reader.metadata.title if reader.metadata else None) or file.stem.replace("_", " ")
        except (PdfReadError, ValueError, OSError) as exc:  # the error says it: pypdf's warnings would repeat it
            raise InputError(f"{file}: cannot read as PDF ({exc})") from None
    if warnings:  # a damaged file read all the same: its text may be incomplete
        print(f"crag index: {file}: pypdf read it with {_named(warnings, 'warning', shown=2)}", file=sys.stderr)
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise InputError(f"{file}: no extractable text (a scanned PDF needs OCR first)")
    return SourceDocument(doc_id=doc_id, title=str(title), text=text, url=None, source_path=str(file), markdown=False)


class Chunker:
    def __init__(self, cfg: IndexingConfig):
        self.parent_splitter = RecursiveCharacterTextSplitter(
            chunk_size=cfg.parent_chars, chunk_overlap=0, separators=SEPARATORS, keep_separator="end"
        )
        self.child_splitter = RecursiveCharacterTextSplitter(
            chunk_size=cfg.child_chars, chunk_overlap=cfg.child_overlap, separators=SEPARATORS, keep_separator="end"
        )
        self.flat = cfg.parents == "chunk"
        self.sections = MarkdownHeaderTextSplitter([("#", "h1"), ("##", "h2"), ("###", "h3")], strip_headers=False)

    def parents(self, doc: SourceDocument) -> list[str]:
        if self.flat:  # reference flow 3: fixed-size chunks, each its own document
            return [c.strip() for c in self.child_splitter.split_text(doc.text) if c.strip()]
        if doc.markdown:
            # One parent per section; a section longer than parent_chars is split further.
            sections = [re.sub(r"[ \t]+\n", "\n", s.page_content) for s in self.sections.split_text(doc.text)]
        else:
            sections = [doc.text]
        return [p.strip() for s in sections for p in self.parent_splitter.split_text(s) if p.strip()]

    def rows(self, doc: SourceDocument) -> Iterator[dict]:
        for p, parent in enumerate(self.parents(doc)):
            parent_id = f"{doc.doc_id}#p{p}"
            children = [parent] if self.flat else self.child_splitter.split_text(parent)
            for c, child in enumerate(children):
                if child.strip():
                    yield {
                        "chunk_id": f"{parent_id}#c{c}",
                        "parent_id": parent_id,
                        "doc_id": doc.doc_id,
                        "title": doc.title,
                        "url": doc.url,
                        "source_path": doc.source_path,
                        "chunk_text": child.strip(),
                        "parent_text": parent,
                    }


def chunk_documents(path: str | Path, cfg: IndexingConfig) -> pa.Table:
    chunker = Chunker(cfg)
    rows: list[dict] = []
    seen: dict[str, tuple[str, bool]] = {}  # doc_id -> where it was read, and whether from a file's path
    without_text: list[str] = []
    for doc in read_documents(path):
        forbidden = forbidden_character(doc.doc_id)
        if forbidden or doc.doc_id != doc.doc_id.strip():
            # gold_doc_ids and the sources name documents by it: an id that prints as another must not be
            raise InputError(
                f"{doc.where}: doc_id {doc.doc_id!r} "
                + (f"contains {forbidden}" if forbidden else "has spaces around it")
            )
        if doc.doc_id in seen:
            first, first_from_path = seen[doc.doc_id]
            raise InputError(
                f"duplicate doc_id {doc.doc_id!r}: in {first} and in {doc.where}"
                + (
                    " (a file's doc_id is its path under the documents folder, without its suffix)"
                    if first_from_path and not doc.place
                    else ""
                )
            )
        seen[doc.doc_id] = (doc.where, not doc.place)  # not the document: its text need not stay in memory
        before = len(rows)
        rows.extend(chunker.rows(doc))
        if len(rows) == before:
            without_text.append(doc.doc_id)
    if not rows:
        raise InputError(f"no text found in {path}")
    if without_text:
        print(f"crag index: left out {_named(without_text, 'document')} without text", file=sys.stderr)
    return pa.Table.from_pylist(rows, schema=schema.CHUNKS)


def build_index(docs: str | Path, out: str | Path, cfg: IndexingConfig) -> dict:
    """Chunk the documents and write the chunk table (Delta) and the BM25 index under `out`, and the
    chunks' dense vectors when `indexing.embedding` names a model."""
    blocking = next((p for p in (Path(out), *Path(out).parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # said before the documents are read and chunked
        raise InputError(f"--out {out}: {blocking} is a file, not a folder")
    chunks = chunk_documents(docs, cfg)
    print(
        f"crag index: {chunks.num_rows} child chunks from {docs}"
        + (f", embedding them with {cfg.embedding}" if cfg.embedding != "none" else ""),
        file=sys.stderr,
    )
    return write_index(chunks, Path(out), cfg.tokenizer, cfg.embedding, cfg.embedding_cache)


def build_knowledge_base(docs: str | Path, out: str | Path, cfg: CragConfig) -> dict:
    """`crag index`: the local index under `out`, and with the Vector Search retriever configured also
    the Unity Catalog chunk table (on Databricks) and its Delta Sync index (created, or synced)."""
    manifest = build_index(docs, out, cfg.indexing)
    r = cfg.retriever
    if r.backend != "databricks_vector_search":
        return manifest

    if on_databricks():  # the Vector Search index syncs from a Unity Catalog table
        if not r.source_table:
            raise InputError("config key 'retriever.source_table' is required: the Unity Catalog chunk table to write")
        tables.write_uc_chunk_table(
            r.source_table, tables.read_whole_table(index_data(out) / "chunks"), get_spark(cfg.spark)
        )
        manifest["source_table"] = r.source_table
        print(f"crag index: chunk table written to {r.source_table}", file=sys.stderr)
    manifest["vector_index"] = (
        f"{sync_vector_index(r, resolve_credentials(cfg))} {r.index_name} on endpoint {r.endpoint}"
    )
    print(f"crag index: Vector Search index {manifest['vector_index']}", file=sys.stderr)
    return manifest
