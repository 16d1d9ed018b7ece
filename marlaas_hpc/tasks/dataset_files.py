"""A task's data on disk as records (prompt, answer, other fields), whatever the file format.

`dataset.path` is one of
- a JSONL file (`.jsonl`): one object per line, read here so that every refusal names its line;
- a JSON file (`.json`: an array of objects, or JSON lines), a parquet file (`.parquet`: what verl's and TRL's
  preprocessing scripts write), or a folder written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict
  whose split `dataset.split` names): read through the `datasets` library (imported only for these).

`dataset.fields` maps the sample's parts to the data's columns: `{prompt: question, answer: answer}`, with dotted
names reaching into nested columns (verl: `{prompt: prompt, answer: reward_model.ground_truth}`). A prompt is
text, or chat messages `[{"role": ..., "content": ...}, ...]` (verl's and TRL's conversational schema), which the
chat template renders as they are (model/codec.py); an answer is text or a number.

Refusals name the field: a file that is missing, unreadable or of no known format, `dataset.path`; a record
without a mapped column or with a value of the wrong shape, `dataset.fields` (with the row and the columns it
has). A save_to_disk folder whose state names data files outside the folder is refused (tenants' paths are
checked against the job's data roots, service/isolation.py, and a folder must not reach past its own).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marlaas_hpc.tasks.spec import SpecError

FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
"""File suffix -> format; a folder is a `save_to_disk` dataset."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Record:
    where: str
    """Where the record is, for messages: 'file:line' (JSONL) or 'path row i'."""
    prompt: str | Messages
    """Prompt text, or chat messages."""
    answer: str
    """The answer column's value as text."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The record's top-level columns but the prompt and answer ones (a column the field map reaches into stays):
    a tenant reward function sees them as sample.meta."""


def read_records(path: str | None, fields: dict[str, str], defaults: dict[str, str],
                 split: str | None = None) -> list[Record]:
    """The records of a data file or folder, with the prompt and answer columns `fields` names (the kind's
    `defaults` for unnamed parts). SpecError naming dataset.path or dataset.fields on any problem."""
    columns = {**defaults, **fields}
    records = []
    for where, row in read_rows(path, split):
        prompt = _prompt(_lookup(row, columns["prompt"], "prompt", where), columns["prompt"], where)
        answer = _answer(_lookup(row, columns["answer"], "answer", where), columns["answer"], where)
        used = {columns["prompt"], columns["answer"]}  # a nested column stays whole: it may hold more
        records.append(Record(where, prompt, answer, {k: v for k, v in row.items() if k not in used}))
    return records


def read_rows(path: str | None, split: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every record of the data at `path`, in order."""
    data = _existing(path)
    kind = data_format(data)
    if kind == "jsonl":
        return [(f"{data}:{lineno}", row) for lineno, row in read_jsonl_rows(str(data))]
    rows = _dataset_rows(data, kind, split)
    if not rows:
        raise SpecError("dataset.path", f"{data}: no samples (0 rows)")
    bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
    if bad is not None:
        raise SpecError("dataset.path", f"{data} row {bad}: expected an object, got {type(rows[bad]).__name__}")
    return [(f"{data} row {i}", row) for i, row in enumerate(rows)]


def read_jsonl_rows(path: str | None, required: tuple[str, ...] = (), field_name: str = "dataset.path",
                    what: str = "no samples") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line; any problem is a SpecError naming file and line."""
    if not path:
        raise SpecError(field_name, "no data file given")
    file = Path(path)
    if not file.is_file():
        raise SpecError(field_name, f"data file not found: {file}")
    rows = []
    for lineno, raw in enumerate(file.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(field_name, f"{file}:{lineno}: not UTF-8 text ({exc.reason} at column {exc.start + 1})"
                            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(field_name, f"{file}:{lineno}: malformed JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise SpecError(field_name, f"{file}:{lineno}: expected a JSON object")
        missing = [key for key in required if not isinstance(row.get(key), str) or not row[key].strip()]
        if missing:
            raise SpecError(field_name, f"{file}:{lineno}: missing, empty or non-string field(s) {missing}")
        rows.append((lineno, row))
    if not rows:
        raise SpecError(field_name, f"{file}: {what} (no non-blank line)")
    return rows


def data_format(path: Path) -> str:
    """'jsonl', 'json', 'parquet' (by suffix) or 'arrow' (a save_to_disk folder)."""
    if path.is_dir():
        if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            raise SpecError("dataset.path", f"{path} is a folder but not one `datasets.save_to_disk` wrote (no "
                                            "state.json or dataset_dict.json)")
        return "arrow"
    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise SpecError("dataset.path", f"{path}: unknown data format {path.suffix!r}; give a "
                                        f"{', '.join(FILE_FORMATS)} file or a save_to_disk folder")
    return kind


def _existing(path: str | None) -> Path:
    if not path:
        raise SpecError("dataset.path", "no data file given")
    data = Path(path)
    if not data.exists():
        raise SpecError("dataset.path", f"data file not found: {data}")
    return data


def _dataset_rows(path: Path, kind: str, split: str | None) -> list[Any]:
    """Rows through the `datasets` library; its caches go to a temporary folder (nothing is left behind)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if kind == "arrow":
            return _split_of(_saved_dataset(path), path, split).to_list()
        with tempfile.TemporaryDirectory(prefix="marlaas-data-") as cache:
            reader = datasets.Dataset.from_parquet if kind == "parquet" else datasets.Dataset.from_json
            return reader(str(path), keep_in_memory=True, cache_dir=cache).to_list()
    except SpecError:
        raise
    except Exception as exc:  # pyarrow, json and datasets each raise their own kinds
        raise SpecError("dataset.path", f"{path}: cannot be read as {kind}: {type(exc).__name__}: "
                                        f"{str(exc)[:300]}") from None


def _saved_dataset(path: Path):
    """`datasets.load_from_disk` of a folder whose data files all lie inside it."""
    import datasets

    splits_file = path / "dataset_dict.json"
    splits = json.loads(splits_file.read_text()).get("splits", []) if splits_file.is_file() else []
    outside = [name for name in splits if not (path / name).resolve().is_relative_to(path.resolve())]
    if outside:
        raise SpecError("dataset.path", f"{splits_file} names splits outside its folder: {outside}")
    for state in [path / "state.json", *path.glob("*/state.json")]:
        if state.is_file():
            names = [entry.get("filename", "") for entry in json.loads(state.read_text()).get("_data_files", [])]
            outside = [n for n in names if not (state.parent / n).resolve().is_relative_to(state.parent.resolve())]
            if outside:
                raise SpecError("dataset.path", f"{state} names data files outside its folder: {outside}")
    return datasets.load_from_disk(str(path), keep_in_memory=True)


def _split_of(saved, path: Path, split: str | None):
    """The Dataset of a load_from_disk result: itself, or the DatasetDict's split (default 'train')."""
    import datasets

    if isinstance(saved, datasets.Dataset):
        if split is not None:
            raise SpecError("dataset.split", f"{path} holds one dataset, not splits: leave dataset.split unset")
        return saved
    name = split or "train"
    if name not in saved:
        raise SpecError("dataset.split", f"{path} has no split {name!r}; its splits: {sorted(saved)}")
    return saved[name]


def _lookup(row: dict[str, Any], column: str, part: str, where: str) -> Any:
    """The value of a dotted column name in a (nested) record."""
    value: Any = row
    for i, key in enumerate(column.split(".")):
        if not isinstance(value, dict) or key not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            inside = f" in {'.'.join(column.split('.')[:i])}" if i else ""
            raise SpecError("dataset.fields", f"{where}: no column {key!r}{inside} (dataset.fields.{part} is "
                                              f"{column!r}); the record has {have}")
        value = value[key]
    return value


def _prompt(value: Any, column: str, where: str) -> str | Messages:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, (list, tuple)) and value and all(_is_message(m) for m in value):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise SpecError("dataset.fields", f"{where}: column {column!r} (the prompt) must be non-empty text or chat "
                                      f"messages [{{role: {'|'.join(CHAT_ROLES)}, content: text}}, ...], got "
                                      f"{_shown(value)}")


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in CHAT_ROLES and isinstance(message.get("content"), str)


def _answer(value: Any, column: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise SpecError("dataset.fields", f"{where}: column {column!r} (the answer) must be non-empty text or a "
                                          f"number, got {_shown(value)}")
    return str(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
