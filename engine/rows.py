"""Dataset rows (DESIGN §2), torch-free so the API validates uploads with the very rules the engine reads by."""

import json

# Required non-empty string fields of a row, per dataset kind.
ROW_FIELDS = {"sft": ("prompt", "completion"), "rm": ("prompt", "chosen", "rejected"), "ppo": ("prompt",)}


class DatasetError(ValueError):
    """A dataset reference names nothing readable, or a row is malformed."""


def validate_row(row: object, kind: str, line: int) -> dict[str, str]:
    """A row of ``kind``, or a DatasetError naming the line and the field."""
    if not isinstance(row, dict):
        raise DatasetError(f"line {line}: expected a JSON object, got {type(row).__name__}")
    for field in ROW_FIELDS[kind]:
        value = row.get(field)
        if not isinstance(value, str) or not value:
            raise DatasetError(f"line {line}: field {field!r} must be a non-empty string")
    return {field: row[field] for field in ROW_FIELDS[kind]}


def parse_line(text: str, kind: str, line: int) -> dict[str, str]:
    """One JSONL line as a row of ``kind``."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"line {line}: invalid JSON ({e.msg})") from None
    return validate_row(row, kind, line)
