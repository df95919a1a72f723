"""Documents -> parent and child chunks -> chunk table + BM25 index (`crag index`).

Parents are what the generator reads (a Markdown section, or a few paragraphs); children are the small
pieces that search matches, each pointing at its parent — the small/large chunk scheme of reference
flow 1. The same chunk table is the source of a Databricks Vector Search index.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from langchain_text_splitters import MarkdownHeaderTextSplitter, RecursiveCharacterTextSplitter

from crag import schema
from crag.config import IndexingConfig
from crag.errors import InputError
from crag.tables import iter_jsonl

# Paragraphs first, then lines, then sentence ends (Western and Japanese), then words, then characters.
SEPARATORS = ["\n\n", "\n", "。", ". ", "！", "？", "! ", "? ", "、", ", ", " ", ""]
TEXT_SUFFIXES = {".md", ".markdown", ".txt"}


@dataclass(frozen=True)
class SourceDocument:
    doc_id: str
    title: str
    text: str
    url: str | None
    source_path: str
    markdown: bool


def read_documents(path: str | Path) -> Iterator[SourceDocument]:
    """JSONL lines {"doc_id", "title", "text", "url"?}, or a folder (searched recursively) of .md/.txt."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"documents not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise InputError(f"no .md or .txt files under {path}")
        for file in files:
            yield _read_text_file(file, path)
    elif path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix.lower() in TEXT_SUFFIXES:
        yield _read_text_file(path, path.parent)
    else:
        raise InputError(f"unsupported documents file {path}: expected .jsonl, .md, .txt or a folder of them")


def _read_jsonl(path: Path) -> Iterator[SourceDocument]:
    for lineno, row in iter_jsonl(path):
        missing = [k for k in ("doc_id", "text") if not isinstance(row.get(k), str) or not row[k].strip()]
        if missing:
            raise InputError(f"{path}:{lineno}: missing or empty string field(s) {', '.join(missing)}")
        yield SourceDocument(
            doc_id=row["doc_id"],
            title=str(row.get("title") or row["doc_id"]),
            text=row["text"],
            url=row.get("url"),
            source_path=str(path),
            markdown=False,
        )


def _read_text_file(file: Path, root: Path) -> SourceDocument:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{file}: not valid UTF-8") from None
    markdown = file.suffix.lower() in {".md", ".markdown"}
    heading = re.search(r"^#\s+(.+)$", text, re.MULTILINE) if markdown else None
    return SourceDocument(
        doc_id=file.relative_to(root).with_suffix("").as_posix(),
        title=heading.group(1).strip() if heading else file.stem.replace("_", " ").replace("-", " "),
        text=text,
        url=None,
        source_path=str(file),
        markdown=markdown,
    )


class Chunker:
    def __init__(self, cfg: IndexingConfig):
        self.parent_splitter = RecursiveCharacterTextSplitter(
            chunk_size=cfg.parent_chars, chunk_overlap=0, separators=SEPARATORS, keep_separator="end"
        )
        self.child_splitter = RecursiveCharacterTextSplitter(
            chunk_size=cfg.child_chars, chunk_overlap=cfg.child_overlap, separators=SEPARATORS, keep_separator="end"
        )
        self.sections = MarkdownHeaderTextSplitter(
            [("#", "h1"), ("##", "h2"), ("###", "h3")], strip_headers=False
        )

    def parents(self, doc: SourceDocument) -> list[str]:
        if doc.markdown:
            # One parent per section; a section longer than parent_chars is split further.
            sections = [re.sub(r"[ \t]+\n", "\n", s.page_content) for s in self.sections.split_text(doc.text)]
        else:
            sections = [doc.text]
        return [p.strip() for s in sections for p in self.parent_splitter.split_text(s) if p.strip()]

    def rows(self, doc: SourceDocument) -> Iterator[dict]:
        for p, parent in enumerate(self.parents(doc)):
            parent_id = f"{doc.doc_id}#p{p}"
            for c, child in enumerate(self.child_splitter.split_text(parent)):
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
    seen: set[str] = set()
    for doc in read_documents(path):
        if doc.doc_id in seen:
            raise InputError(f"duplicate doc_id {doc.doc_id!r} in {doc.source_path}")
        seen.add(doc.doc_id)
        rows.extend(chunker.rows(doc))
    if not rows:
        raise InputError(f"no text found in {path}")
    return pa.Table.from_pylist(rows, schema=schema.CHUNKS)


def build_index(docs: str | Path, out: str | Path, cfg: IndexingConfig) -> dict:
    """Chunk the documents and write the chunk table (Delta) and the BM25 index under `out`."""
    from crag.backends.bm25 import write_index  # the index format lives with its reader

    chunks = chunk_documents(docs, cfg)
    print(f"crag index: {chunks.num_rows} child chunks from {docs}", file=sys.stderr)
    return write_index(chunks, Path(out), cfg.tokenizer)
