"""The first stage: read and validate the question table. Every input row ends up either accepted or
as a reject row with a readable reason, never dropped.

`read_questions` reads with Spark (a catalog table, a Delta folder, or JSONL / Parquet / CSV files), so
the driver never holds the questions. `validate` numbers the rows, checks each one in the Python
workers (`check_rows`, a pure function over a pandas frame) and marks repeated ids in Spark.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import re
import tokenize
import unicodedata
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from crag import schema
from crag.errors import InputError, describe, spark_error_line
from crag.ids import forbidden_character, id_key
from crag.text import csv_records, encodable, invisible, parse_json_line

REQUIRED = ("question_id", "question")
# Optional columns that say what the right outcome is, for `crag eval`.
GOLD_COLUMNS = ("answers", "is_impossible", "expected_route", "gold_doc_ids")
EXPECTED_ROUTES = ("internal", "web", "none")
QUESTION_FILE_SUFFIXES = (".jsonl", ".parquet", ".csv")
# C0/C1 control characters except tab, newline and carriage return, which are ordinary whitespace.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# A length past which an id is surely a question or a document pasted into the wrong column.
MAX_ID_CHARS = 1000
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no", ""}
# What a JSONL line becomes before it is checked: its bytes, decoded and parsed in the workers (Spark's JSON
# reader would turn a number in a text column into text, and one bad line into nulls).
JSONL_LINE = "value"
# The checked rows, before repeated ids are marked: INPUTS without the run's own columns, with the id's
# problem and the key repeated ids are found by (its NFC form).
CHECKED = pa.schema(
    [f for f in schema.INPUTS if f.name not in ("run_id", "generation", "variant", "created_at")]
    + [pa.field("id_problem", pa.bool_()), pa.field("id_key", pa.string())]
)


def question_key(question: str) -> str:
    """What the stage cache files a question's stored results under (crag.cache): its text's hash."""
    return hashlib.sha256(question.encode("utf-8")).hexdigest()[:24]


# ------------------------------------------------------------------ reading (Spark)


def _catalog_name(source: str) -> bool:
    """catalog.schema.table or schema.table, not a file; a missing file's name (questions.jsonl) is no
    schema.table either (catalog.schema.parquet still is a table)."""
    if not re.fullmatch(r"[\w`]+(\.[\w`]+){1,2}", source) or Path(source).exists():
        return False
    return source.count(".") == 2 or Path(source).suffix.lower() not in QUESTION_FILE_SUFFIXES


def read_questions(spark, source: str):
    """A Spark DataFrame of the raw rows: a catalog table name, a Delta folder, or a .jsonl / .parquet /
    .csv file (CSV columns are read as text: ids such as 007 stay as they are)."""
    try:
        if _catalog_name(source):
            if not spark.catalog.tableExists(source):
                raise InputError(f"questions table {source} not found")
            return _require_columns(spark.table(source), source)
        path = Path(source)
        if not path.exists():
            raise InputError(f"questions not found: {path}")
        if path.is_dir():
            log = path / "_delta_log"
            if not log.is_dir():
                raise InputError(f"{path} is a folder but not a Delta table (no _delta_log)")
            if not any(log.glob("*.json")) and not any(log.glob("*.checkpoint*.parquet")):
                raise InputError(f"{path} is not a readable Delta table: its _delta_log holds no commit")
            return _require_columns(spark.read.format("delta").load(str(path.resolve())), source)
        suffix = path.suffix.lower()
        if ":" in path.name and suffix in QUESTION_FILE_SUFFIXES:
            raise InputError(
                f"Spark cannot read a file whose name holds ':' (Hadoop reads it as a URI scheme): "
                f"rename or copy {path}"
            )
        literal = _literal(path.resolve())
        if suffix == ".jsonl":
            # The raw bytes of each line: a line that is not UTF-8 is rejected in the workers, alone.
            lines = spark.read.text(literal)
            return lines.where(f"trim({JSONL_LINE}) != ''").selectExpr(f"cast({JSONL_LINE} AS binary) AS {JSONL_LINE}")
        if suffix == ".parquet":
            if path.stat().st_size == 0:
                raise InputError(f"{path} is empty: not a Parquet file")
            return _require_columns(_read_parquet(spark, path, literal, source), source)
        if suffix == ".csv":
            return _read_csv(spark, path, literal, source)
    except spark_errors() as exc:
        raise InputError(f"cannot read questions from {source}: {spark_error_line(exc)}") from None
    raise InputError(
        f"unsupported questions file {source}: expected a Delta folder or {', '.join(QUESTION_FILE_SUFFIXES)}"
    )


def _read_csv(spark, path: Path, literal: str, source: str):
    """A CSV file's records, read strictly in a Spark task (crag.text.csv_records; Spark's own reader
    lets an unterminated quote swallow the rows after it, and drops a row's extra fields): the
    question and gold columns as text, and CSV_PROBLEM, what is wrong with a record that is not well
    formed, which becomes its reject row. The driver reads the header alone."""
    from pyspark.sql.pandas.types import from_arrow_schema  # noqa: PLC0415

    header = _csv_header(path, source)
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise InputError(
            f"questions lack column(s) {', '.join(missing)} (found: {', '.join(header) or 'none'}) in {source}"
        )
    columns = [c for c in (*REQUIRED, *GOLD_COLUMNS) if c in header]
    records = pa.schema([pa.field(c, pa.string()) for c in (*columns, CSV_PROBLEM)])

    def parse(batches):
        for batch in batches:
            for content in batch.column("content").to_pylist():
                yield from _csv_batches(content, columns, records)

    files = spark.read.format("binaryFile").load(literal).select("content")
    return files.mapInArrow(parse, from_arrow_schema(records))


CSV_PROBLEM = "csv_problem"
_CSV_BATCH_ROWS = 10_000


def _csv_header(path: Path, source: str) -> list[str]:
    """The CSV file's header record (its first), read on the driver: the columns it names."""
    with open(path, "rb") as file:
        head = file.read(1 << 20).decode("utf-8-sig", errors="replace")
    first = next(iter(csv_records(head)), None)
    if first is None:
        raise InputError(f"questions {source} hold no rows")
    if first.fields is None:
        raise InputError(f"the header of {source} (line {first.line}) is not readable as CSV: {first.problem}")
    repeated = sorted({c for c in first.fields if first.fields.count(c) > 1})
    if repeated:
        raise InputError(f"the header of {source} names column(s) {', '.join(repeated)} more than once")
    return first.fields


def _csv_batches(content: bytes, columns: list[str], records: pa.Schema) -> Iterator[pa.RecordBatch]:
    """A CSV file's data records as Arrow batches of `records` (empty fields null, as Spark reads them)."""
    parsed = csv_records(content.decode("utf-8-sig", errors="replace"))  # a byte not UTF-8 shows as U+FFFD
    header = next(parsed).fields or []
    at = {c: header.index(c) for c in columns}
    rows: list[dict] = []
    for record in parsed:
        if record.fields is None:
            rows.append({"question": record.line_text, CSV_PROBLEM: f"CSV line {record.line}: {record.problem}"})
        else:
            rows.append({c: record.fields[i] or None for c, i in at.items()})
        if len(rows) == _CSV_BATCH_ROWS:
            yield pa.RecordBatch.from_pylist(rows, schema=records)
            rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=records)


def _read_parquet(spark, path: Path, literal: str, source: str):
    """A Parquet file's question and gold columns only: Spark reads a file's whole schema when it infers
    it, and refuses some types it does not need (pandas' nanosecond timestamps), which would make an
    unrelated column fail the file. Given the columns it reads (their types from the file's footer),
    it reads no other."""
    import pyarrow.parquet as pq  # noqa: PLC0415
    from pyspark.sql.types import StructField, StructType  # noqa: PLC0415

    try:
        wanted = [f for f in pq.read_schema(path) if f.name in (*REQUIRED, *GOLD_COLUMNS)]
    except Exception:  # a footer pyarrow cannot read: Spark says what is wrong with the file
        return spark.read.parquet(literal)
    if not set(REQUIRED) <= {f.name for f in wanted}:  # _require_columns names what is missing, and what is there
        return spark.read.parquet(literal)
    fields = []
    for f in wanted:
        try:
            spark_type = _spark_type(f.type)
        except LookupError:  # a type pyspark has no match for: Spark's own reading of the file decides
            return spark.read.parquet(literal)
        if spark_type is None:  # read lazily, it would fail only once the run has started
            raise InputError(
                f"cannot read questions from {source}: column {f.name} is {f.type}, which Spark does not read"
            )
        fields.append(StructField(f.name, spark_type, True))
    return spark.read.schema(StructType(fields)).parquet(literal)


def _spark_type(arrow_type: pa.DataType):
    """The Spark type a Parquet column of `arrow_type` is read as, None when Spark refuses it (LookupError
    when pyspark knows no match)."""
    from pyspark.sql.pandas.types import from_arrow_type  # noqa: PLC0415
    from pyspark.sql.types import ArrayType, DecimalType, IntegerType, LongType, ShortType, StringType  # noqa: PLC0415

    unsigned = {
        pa.uint8(): ShortType(),
        pa.uint16(): IntegerType(),
        pa.uint32(): LongType(),
        pa.uint64(): DecimalType(20, 0),
    }
    if arrow_type in unsigned:  # as Spark reads Parquet's unsigned integers
        return unsigned[arrow_type]
    if pa.types.is_timestamp(arrow_type) and arrow_type.unit == "ns":
        return None
    if pa.types.is_string_view(arrow_type):
        return StringType()
    if pa.types.is_dictionary(arrow_type):  # pandas' categoricals: Parquet stores their values
        return _spark_type(arrow_type.value_type)
    if pa.types.is_null(arrow_type):  # a column of nulls only: Spark reads it as it sees fit
        raise LookupError(arrow_type)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        element = _spark_type(arrow_type.value_type)
        return None if element is None else ArrayType(element, True)
    try:
        return from_arrow_type(arrow_type)
    except Exception as exc:
        raise LookupError(arrow_type) from exc


def _literal(path: Path) -> str:
    """The path as Spark's file readers take it literally: they expand glob patterns, so `[1]` in a
    name would read `1` instead (another file, silently); each pattern character is escaped."""
    return re.sub(r"([\\\[\]{}*?])", r"\\\1", str(path))


def spark_errors() -> tuple[type[BaseException], ...]:
    """What Spark raises for unreadable data: its own errors, and on classic Spark a Java error that
    pyspark did not translate."""
    from pyspark.errors import PySparkException

    try:
        from py4j.protocol import Py4JJavaError
    except ImportError:  # Spark Connect clients have no py4j
        return (PySparkException,)
    return (PySparkException, Py4JJavaError)


def _require_columns(frame, source: str):
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise InputError(
            f"questions lack column(s) {', '.join(missing)} (found: {', '.join(frame.columns) or 'none'}) in {source}"
        )
    return frame.select(*[c for c in (*REQUIRED, *GOLD_COLUMNS) if c in frame.columns])


# ------------------------------------------------------------------ checking one row (pure)


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and value != value) or value is pd.NA


def _storable(value):
    """Text that cannot be encoded is kept, escaped, for the reject row."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(value, str) else None


def _id_text(value) -> str | None:
    """Ids may arrive as strings or integers (Parquet, Delta); both become strings, without the spaces
    around them (as a CSV cell's " q1" is q1; a tab or newline is rejected, not trimmed). Floats that
    hold an integer lose their ".0"."""
    if _is_missing(value):
        return None
    if isinstance(value, (float, np.floating, Decimal)) and math.isfinite(value) and value == int(value):
        value = int(value)  # Spark reads an unsigned 64-bit integer as a decimal
    if isinstance(value, (str, int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        text = str(value).strip(" ")
        return text or None
    return None


def _id_problem(raw, qid: str | None) -> str | None:
    if qid is None:
        if _is_missing(raw) or str(raw).strip() == "":
            return "question_id is missing"
        return f"question_id is not text or an integer (got {type(raw).__name__})"
    if not encodable(qid):
        return "question_id is not valid text (it holds a lone surrogate)"
    if "\ufffd" in qid:  # undecodable bytes of different ids would read as the same id
        return "question_id holds U+FFFD, the replacement character: the input was probably not UTF-8"
    forbidden = forbidden_character(qid)
    if forbidden:
        return f"question_id contains {forbidden}"
    if len(qid) > MAX_ID_CHARS:
        return f"question_id is {len(qid)} characters; the limit is {MAX_ID_CHARS}"
    return None


def question_problem(question, max_chars: int) -> str | None:
    if _is_missing(question):
        return "question is missing (null)"
    if not isinstance(question, str):
        return f"question is not text (got {type(question).__name__})"
    if question == "":
        return "question is empty"
    if not question.strip():
        return "question is only whitespace"
    if not any(not c.isspace() and not invisible(c) for c in question):
        return "question has no visible character (only characters that show nothing, such as zero-width spaces)"
    if not encodable(question):
        return "question is not valid text: it holds a lone surrogate (an unpaired \\ud800-\\udfff escape)"
    if "\ufffd" in question:
        return "question holds U+FFFD, the replacement character: the input was probably not UTF-8"
    if len(question) > max_chars:
        return f"question is {len(question)} characters; the limit is {max_chars} (input.max_question_chars)"
    control = _CONTROL.search(question)
    if control:
        char = control.group(0)
        return f"question contains control character U+{ord(char):04X} ({unicodedata.name(char, 'unnamed')}) at position {control.start()}"
    return None


def _string_list(value, column: str):
    """Gold lists: a list of strings, one string, or null (= empty). Text that spells a list of strings
    (a CSV cell, where a list can only be text) is that list; any other text is a list of one."""
    if isinstance(value, str):
        items = _written_list(value)
        value = [value] if items is None else items
    if not isinstance(value, (list, tuple, np.ndarray)):
        if _is_missing(value):
            return []
        shown = value.item() if isinstance(value, np.generic) else value
        raise ValueError(f"{column} must be a list of strings (got {shown!r})")
    if not all(isinstance(v, str) and encodable(v) for v in value):
        raise ValueError(f"{column} must be a list of valid strings")
    return list(value)


# Past this, text is not read as Python's spelling of a list (tokenizing it costs about 200 bytes of
# memory per character); JSON has no such limit.
_MAX_PYTHON_LIST_CHARS = 100_000


def _written_list(text: str) -> list[str] | None:
    """The list of strings `text` spells, or None: a JSON array (`["a", "b"]`), a Python list
    (`['a', 'b']`, as pandas writes a list column to CSV) or a numpy array of strings (`['a' 'b']`, as
    pandas writes one read from Parquet). Python's literals are read one string token at a time (never
    evaluated as a whole: `'a' 'b'` would be one string, and code is not run)."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        items = json.loads(text)
    except ValueError:
        items = None
    if isinstance(items, list):
        return items if all(isinstance(i, str) for i in items) else None
    if len(text) > _MAX_PYTHON_LIST_CHARS:
        return None
    try:
        tokens = [
            t
            for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER)
        ]
    except (tokenize.TokenError, SyntaxError):
        return None
    if [t.string for t in (tokens[0], tokens[-1])] != ["[", "]"]:
        return None
    strings, separators = tokens[1:-1:2], tokens[2:-1:2]
    if any(t.type != tokenize.STRING for t in strings) or any(t.string != "," for t in separators):
        # numpy's form: strings apart from each other (with no space between, Python would join them)
        if any(t.type != tokenize.STRING for t in tokens[1:-1]) or any(
            a.end == b.start for a, b in zip(tokens[1:-1], tokens[2:-1])
        ):
            return None
        strings = tokens[1:-1]
    items = []
    for token in strings:
        try:
            item = ast.literal_eval(token.string)
        except (ValueError, SyntaxError):
            return None
        if not isinstance(item, str):
            return None
        items.append(item)
    return items


def gold_of(row: dict) -> dict:
    """The gold columns of one row, normalised (absent ones None); ValueError names the bad one."""
    gold: dict = {c: None for c in GOLD_COLUMNS}
    if "answers" in row:
        gold["answers"] = _string_list(row["answers"], "answers")
    if "gold_doc_ids" in row:
        gold["gold_doc_ids"] = _string_list(row["gold_doc_ids"], "gold_doc_ids")
    if "is_impossible" in row:
        value = row["is_impossible"]
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            value = value.strip().lower() in _TRUE
        elif _is_missing(value):
            value = None
        elif isinstance(value, (int, float, np.integer, np.floating)) and value in (0, 1):
            value = bool(value)  # 0 / 1, as CSV's "0" / "1" are read
        elif not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"is_impossible must be true or false (got {value!r})")
        gold["is_impossible"] = None if value is None else bool(value)
    if "expected_route" in row:
        value = row["expected_route"]
        if _is_missing(value):
            value = None
        elif not isinstance(value, str) or value not in EXPECTED_ROUTES:  # `in` is elementwise on an array
            shown = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
            raise ValueError(f"expected_route must be one of {', '.join(EXPECTED_ROUTES)} (got {shown!r})")
        gold["expected_route"] = value
    return gold


def check_rows(frame: pd.DataFrame, max_chars: int) -> pd.DataFrame:
    """Check each raw row on its own (repeated ids are a question for the whole table: see
    `validate`). `frame` has either a JSONL line column or the question columns, and `input_row`.
    Returns CHECKED columns: reason is null for a good row; id_problem says the id itself is bad."""
    out = []
    for record in frame.to_dict("records"):
        try:
            out.append(_checked(record, max_chars))
        except Exception as exc:  # a value no check foresaw: its row is rejected, the others go on
            out.append(
                {
                    **{c: None for c in CHECKED.names},
                    "input_row": int(record["input_row"]),
                    "reason": f"row could not be checked ({describe(exc, limit=200)})",
                    "has_gold": False,
                    "id_problem": True,  # its id is not known to be good: it takes no part in the duplicate check
                    "id_key": None,
                }
            )
    return pd.DataFrame(out, columns=CHECKED.names)


def _checked(record: dict, max_chars: int) -> dict:
    """One raw row checked: a CHECKED row."""
    row, reason = (
        parse_json_line(record[JSONL_LINE])
        if JSONL_LINE in record
        else ({k: v for k, v in record.items() if k not in ("input_row", CSV_PROBLEM)}, record.get(CSV_PROBLEM))
    )
    row = row or {}
    qid = _id_text(row.get("question_id"))
    id_reason = reason or _id_problem(row.get("question_id"), qid)
    gold = {c: None for c in GOLD_COLUMNS}
    reason = id_reason or question_problem(row.get("question"), max_chars)
    if reason is None:
        try:
            gold = gold_of(row)
        except ValueError as exc:
            reason = str(exc)
    question = row.get("question")
    return {
        "question_id": _storable(qid),
        "question": _storable(question) if reason else question,
        "question_key": None if reason else question_key(str(question)),
        "input_row": int(record["input_row"]),
        "reason": reason,
        "has_gold": any(c in row for c in GOLD_COLUMNS),
        **gold,
        "id_problem": id_reason is not None,
        "id_key": None if id_reason is not None else id_key(qid),  # type: ignore[arg-type]  # a good id is text
    }


# ------------------------------------------------------------------ the whole table (Spark)


def checked_input(spark, source: str, max_chars: int, tasks: int):
    """The rows of `source` read and checked (`validate`), once and lazily: a run's first batch and the
    storage of its input read them at once and share the one computation (their Python checks would
    otherwise run side by side, in more Python workers than a batch has tasks: see validate)."""
    return validate(spark, read_questions(spark, source), max_chars, source, tasks).localCheckpoint(eager=False)


def validate(spark, raw, max_chars: int, source: str, tasks: int | None = None):
    """The checked rows of the whole table (RUN_INPUTS without run_id), in Spark: each row numbered by
    its position in the input (0-based; blank JSONL lines not counted), checked on its own, and of rows
    sharing a question_id the first that passes its checks kept and the later ones rejected. `source`:
    where the rows came from (a path or a table name), for the messages. `tasks`: at most so many
    partitions are checked at once (a batch's tasks): the checks run in the Python workers that
    answer the batches, and Spark starts one for every task that runs at once and hands them out in
    turn, so a third worker would load the indexes too (half a gigabyte at bench/scale.py's size)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    numbered = _numbered(spark, raw.coalesce(tasks) if tasks else raw, source)

    def check(frames):
        for frame in frames:
            yield check_rows(frame, max_chars)

    checked = numbered.mapInPandas(check, from_arrow_schema(CHECKED))
    # The row kept is the first that passes its own checks (a row rejected for itself must not cost its
    # id the answer of a good row after it). Ids are one id when their NFC forms are (crag.ids.id_key).
    same_id = Window.partitionBy("id_key")
    first = F.min(F.when(F.col("reason").isNull(), F.col("input_row"))).over(same_id)
    first_spelling = F.min(F.when(F.col("input_row") == F.col("first_row"), F.col("question_id"))).over(same_id)
    duplicate = F.concat(
        F.lit("duplicate question_id '"),
        F.col("question_id"),
        F.when(  # spelt otherwise: NFC and NFD forms print alike
            F.col("question_id") != F.col("first_spelling"), F.lit("', spelt otherwise (the same id in NFC)")
        ).otherwise(F.lit("'")),
        F.lit(": first seen at input row "),
        F.col("first_row").cast("string"),
    )
    return (
        checked.withColumn("first_row", F.when(~F.col("id_problem"), first))
        .withColumn("first_spelling", first_spelling)
        .withColumn(
            "reason",
            F.when(
                ~F.col("id_problem") & F.col("reason").isNull() & (F.col("input_row") > F.col("first_row")), duplicate
            ).otherwise(F.col("reason")),
        )
        .drop("first_row", "first_spelling", "id_problem", "id_key")
    )


def _numbered(spark, raw, source: str):
    """raw with `input_row`: a row's position in the input, from each partition's row count (one small
    aggregate) and the row's offset in its partition, without moving the rows. The same aggregate
    finds a JSONL file's required key that no line has (InputError, as a CSV file's missing column)."""
    from pyspark.sql import functions as F

    tagged = raw.withColumn("_id", F.monotonically_increasing_id()).withColumn("_part", F.spark_partition_id())
    aggregates = [F.count(F.lit(1)).alias("count")]
    jsonl = raw.columns == [JSONL_LINE]
    if jsonl:  # which required keys some line has: a key no line has is a missing column, as in CSV
        keys = F.json_object_keys(F.col(JSONL_LINE).cast("string"))  # null for a line that is no JSON object
        aggregates += [F.max(keys.isNotNull()).alias("_objects")]
        aggregates += [F.max(F.array_contains(keys, c)).alias(c) for c in REQUIRED]
    try:
        parts = sorted(tagged.groupBy("_part").agg(*aggregates).collect(), key=lambda r: r["_part"])
    except spark_errors() as exc:
        raise InputError(f"cannot read questions: {spark_error_line(exc)}") from None
    offsets, total = [], 0
    for part in parts:
        offsets.append((part["_part"], total))
        total += part["count"]
    if total == 0:
        raise InputError(f"questions {source} hold no rows")
    if jsonl and any(p["_objects"] for p in parts):  # a file of lines that are no objects: reject rows say why
        missing = [c for c in REQUIRED if not any(p[c] for p in parts)]
        if missing:
            raise InputError(
                f"questions lack column(s) {', '.join(missing)}: no line of {source} has "
                + ("that key" if len(missing) == 1 else "those keys")
            )
    starts = spark.createDataFrame(offsets, "_part int, _start long")
    # monotonically_increasing_id: the partition index in the upper 31 bits, the row's offset below
    position = F.col("_id") - F.shiftleft(F.col("_part").cast("long"), 33)
    return (
        tagged.join(F.broadcast(starts), "_part")
        .withColumn("input_row", F.col("_start") + position)
        .drop("_id", "_part", "_start")
    )


def check_one(question_id: str, question: str, max_chars: int) -> None:
    """`crag ask`: the same checks for one question, as an InputError."""
    checked = check_rows(
        pd.DataFrame({"question_id": [question_id], "question": [question], "input_row": [0]}), max_chars
    )
    if checked["reason"].iloc[0]:
        raise InputError(checked["reason"].iloc[0])
