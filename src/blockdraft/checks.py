"""What a check of `blockdraft doctor` says: its name, PASS, WARN, FAIL or SKIP, a one-line message, and what to
do. The checks themselves live with what they check (doctor.py, and each engine's own in engines/)."""

from __future__ import annotations

from dataclasses import dataclass

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str = ""
