"""Office and table files for `crag index`, read through LangChain document loaders (the `langchain`
extra, so the default install stays lean):

- .docx: langchain-community's Docx2txtLoader (docx2txt): the text of the document, paragraphs kept.
- .pptx: PptxLoader below (python-pptx; langchain-community's own PowerPoint loader needs the heavy
  `unstructured`): one Markdown section per slide, so each slide becomes a parent chunk.
- .csv / .tsv: langchain-community's CSVLoader: one document per row, "column: value" lines. Columns
  named doc_id, title and url fill those fields instead of the text.
"""

from __future__ import annotations

import csv
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from langchain_core.document_loaders import BaseLoader
from langchain_core.documents import Document

from crag.errors import InputError

LOADER_SUFFIXES = {".docx", ".pptx", ".csv", ".tsv"}
_FIELD_COLUMNS = ("doc_id", "title", "url")


@dataclass(frozen=True)
class LoadedDocument:
    doc_id: str
    title: str
    text: str
    url: str | None
    markdown: bool
    row: int | None = None  # a CSV or TSV row's number (its doc_id's default says row-N)


def _community():
    """langchain_community's loaders, or a one-line error naming the extra to install."""
    try:
        with warnings.catch_warnings():  # it warns on import that it is being sunset; crag pins what it uses
            warnings.simplefilter("ignore", DeprecationWarning)
            import langchain_community.document_loaders as loaders  # noqa: PLC0415  # langchain extra
    except ImportError:
        return None
    return loaders


def _needs_extra(file: Path, library: str) -> InputError:
    return InputError(f"{file}: reading {file.suffix.lower()} files needs {library}: pip install 'crag[langchain]'")


class PptxLoader(BaseLoader):
    """A PowerPoint deck as one Markdown document: a `## ` heading per slide (its title, else "Slide N"),
    then the text of its shapes and tables, then its speaker notes."""

    def __init__(self, file_path: str | Path):
        self.file_path = Path(file_path)

    def lazy_load(self) -> Iterator[Document]:
        from pptx import Presentation  # noqa: PLC0415  # langchain extra

        deck = Presentation(str(self.file_path))
        sections = []
        first_title = None
        for number, slide in enumerate(deck.slides, start=1):
            title_shape = slide.shapes.title
            title = (
                title_shape.text_frame.text.strip() if title_shape is not None and title_shape.has_text_frame else ""
            )
            first_title = first_title or title or None
            lines = []
            for shape in slide.shapes:
                if title_shape is not None and shape.shape_id == title_shape.shape_id:
                    continue
                if shape.has_text_frame:
                    lines += [p for p in (para.text.strip() for para in shape.text_frame.paragraphs) if p]
                if getattr(shape, "has_table", False):
                    lines += [" | ".join(cell.text.strip() for cell in row.cells) for row in shape.table.rows]
            if slide.has_notes_slide:
                notes = slide.notes_slide.notes_text_frame.text.strip() if slide.notes_slide.notes_text_frame else ""
                if notes:
                    lines.append(notes)
            if lines or title:
                sections.append(f"## {title or f'Slide {number}'}\n\n" + "\n\n".join(lines))
        yield Document(
            page_content="\n\n".join(sections),
            metadata={
                "source": str(self.file_path),
                "title": deck.core_properties.title or first_title,
                "slides": len(deck.slides),
            },
        )


def load_file(file: Path, doc_id: str) -> list[LoadedDocument]:
    """The documents in one .docx, .pptx, .csv or .tsv file; `doc_id` is the file's (rows add /row-N)."""
    suffix = file.suffix.lower()
    stem_title = file.stem.replace("_", " ").replace("-", " ")
    if suffix == ".pptx":
        try:
            import pptx  # noqa: F401, PLC0415  # langchain extra: the library PptxLoader reads with
        except ImportError:
            raise _needs_extra(file, "python-pptx") from None
        try:
            [deck] = PptxLoader(file).load()
        except Exception as exc:  # python-pptx raises several kinds for a file that is not a deck
            raise InputError(f"{file}: cannot read as PowerPoint ({type(exc).__name__})") from None
        title = deck.metadata["title"] or stem_title
        return [LoadedDocument(doc_id, title, deck.page_content, None, markdown=True)]
    loaders = _community()
    if loaders is None:
        raise _needs_extra(file, "langchain-community")
    if suffix == ".docx":
        try:
            import docx2txt  # noqa: F401, PLC0415  # langchain extra: the library Docx2txtLoader reads with
        except ImportError:
            raise _needs_extra(file, "docx2txt") from None
        try:
            [doc] = loaders.Docx2txtLoader(str(file)).load()
        except Exception as exc:  # a zip that is not a Word document, or no zip at all
            raise InputError(f"{file}: cannot read as Word .docx ({type(exc).__name__})") from None
        text = "\n\n".join(p.strip() for p in doc.page_content.split("\n") if p.strip())
        return [LoadedDocument(doc_id, stem_title, text, None, markdown=False)]
    return _load_table(loaders, file, doc_id, stem_title, delimiter="\t" if suffix == ".tsv" else ",")


def _load_table(loaders, file: Path, doc_id: str, stem_title: str, delimiter: str) -> list[LoadedDocument]:
    try:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name
        with file.open(encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f, delimiter=delimiter), [])
        field_columns = [c for c in _FIELD_COLUMNS if c in header]
        # a short row's missing cells are empty, a long row's extra cells are kept under "more" (or, when
        # the header has that column, a name it does not have)
        more = "more"
        while more in header:
            more = f"_{more}"
        csv_args = {"delimiter": delimiter, "restval": "", "restkey": more}
        rows = loaders.CSVLoader(
            str(file), metadata_columns=field_columns, encoding="utf-8-sig", csv_args=csv_args
        ).load()
    except UnicodeDecodeError:
        raise InputError(f"{file}: not valid UTF-8") from None
    except (RuntimeError, ValueError, csv.Error) as exc:  # CSVLoader wraps what it cannot decode or parse
        cause = exc.__cause__ or exc
        reason = "not valid UTF-8" if isinstance(cause, UnicodeDecodeError) else f"cannot read as CSV ({cause})"
        raise InputError(f"{file}: {reason}") from None
    if not header:
        raise InputError(f"{file}: empty file, expected a header line and rows")
    documents = []
    for row in rows:
        number = row.metadata["row"] + 1
        if not any(line.partition(": ")[2].strip() for line in row.page_content.splitlines()):
            continue  # a row of empty cells
        documents.append(
            LoadedDocument(
                doc_id=row.metadata.get("doc_id") or f"{doc_id}/row-{number}",
                title=row.metadata.get("title") or f"{stem_title}, row {number}",
                text=row.page_content,
                url=row.metadata.get("url") or None,
                markdown=False,
                row=number,
            )
        )
    return documents
