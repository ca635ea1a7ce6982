"""What a service of a shared stack logged during one test. The session's stacks serve every test's runs and
their services append to one log each, so a test takes a log's size before its runs and reads what follows."""
from __future__ import annotations

import json
from pathlib import Path


def text_after(log: Path, offset: int) -> str:
    """What the service wrote to `log` after byte `offset`."""
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode()


def records_after(log: Path, offset: int) -> list[dict]:
    """The structured (JSON) records written to `log` after byte `offset`."""
    return [json.loads(line) for line in text_after(log, offset).splitlines() if line.startswith("{")]
