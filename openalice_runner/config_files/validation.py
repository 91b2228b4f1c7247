"""pydantic's validation errors as problems at FILE:LINE:COL, for files read with load_located."""

from __future__ import annotations

from pydantic import ValidationError

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.yaml_nodes import Located


def validation_problems(exc: ValidationError, loc: Located) -> list[Problem]:
    """One problem per error, where it sits in the file: an unknown key at the key, anything else
    at its value (or the nearest enclosing value the file has)."""
    problems = []
    for err in exc.errors(include_url=False):
        path = loc.data_path(err["loc"])
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            problems.append(loc.problem(path, f"unknown key {err['loc'][-1]!r} at {where}", key=True))
        elif err["type"] == "missing":
            problems.append(loc.problem(path, f"{where}: missing required key"))
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            problems.append(loc.problem(path, f"{where}: {message}"))
    return list(dict.fromkeys(problems))
