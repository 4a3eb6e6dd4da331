"""Shared helpers of dew-data's tests."""

import json

import pytest


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, rows)``: one JSON object a line."""

    def write(path, rows):
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return path

    return write
