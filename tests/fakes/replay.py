"""Driving the fake tool executables in tests/fakes/bin that replay a recorded output named by an env var."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def replay(monkeypatch: Any, tmp_path: Path, prefix: str) -> Callable[[str], None]:
    """`use(name)` picks the fixture the fake replays; `use.calls()` lists the argument lists it was run with."""
    log = tmp_path / "calls.log"
    monkeypatch.setenv(f"{prefix}_LOG", str(log))

    def use(name: str) -> None:
        monkeypatch.setenv(f"{prefix}_OUTPUT", name)

    use.calls = lambda: [json.loads(line) for line in log.read_text().splitlines()]  # type: ignore[attr-defined]
    return use
