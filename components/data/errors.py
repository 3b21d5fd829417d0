"""Errors for bad input data. Every message names the file (and line, when there is one) and a fix."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data: the message says which file, which line, and what to do."""

    def __init__(self, path: object, problem: str, *, line: int | None = None, fix: str | None = None):
        where = f"{path}:{line}" if line is not None else f"{path}"
        msg = f"{where}: {problem}"
        if fix:
            msg += f" -- fix: {fix}"
        super().__init__(msg)
        self.path, self.line, self.problem, self.fix = str(path), line, problem, fix
