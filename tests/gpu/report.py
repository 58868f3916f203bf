"""Reporting of tests/gpu/check.py, shared with its section modules: checks, sections, the log."""

from __future__ import annotations

PARITY_TOL = 1e-4

LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


class Report:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.sections: dict[str, dict] = {}
        self.info: dict = {}

    def check(self, name: str, ok: bool, **values) -> None:
        self.checks.append({"name": name, "ok": bool(ok), **values})
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        log(f"  [{'PASS' if ok else 'FAIL'}] {name} {shown}")

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks) and all(s.get("ok", False) for s in self.sections.values())


def _fmt(v) -> str:
    return f"{v:.3e}" if isinstance(v, float) else str(v)
