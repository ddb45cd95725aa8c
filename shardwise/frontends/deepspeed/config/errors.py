"""The error a bad config raises, and the translation of pydantic's errors into its lines."""

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config shardwise cannot run. `problems` holds one line per problem found, each naming
    the dotted key it concerns, so one run of a broken config reports everything wrong with it."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            message = f"{len(self.problems)} problems in the shardwise config:\n{lines}"
        super().__init__(message)


def join_key(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def describe_validation_error(error: ValidationError, prefix: str = "") -> list[str]:
    """One line per pydantic error, located by its dotted key under `prefix`. A value that
    fails every member of a union (a rate or a list of rates) is one problem: the members'
    tags leave the key, and the member whose type the value has speaks for it."""
    by_key: dict[str, list[dict]] = {}
    for detail in error.errors(include_url=False):
        key = join_key(prefix, ".".join(str(part) for part in detail["loc"] if not _union_member(part)))
        by_key.setdefault(key, []).append(detail)
    lines = []
    for key, details in by_key.items():
        fitting = [detail for detail in details if not detail["type"].endswith("_type")]
        if not fitting and any(other.startswith(f"{key}.") for other in by_key):
            continue  # a type mismatch with one member, where another member's element failed deeper
        fitting = fitting or details[:1]
        for detail in fitting:
            lines.append(_line(key, detail))
    return lines


def _union_member(part: str | int) -> bool:
    """pydantic names a union's member in the location (`list[...]`, `function-after[...]`,
    `float`); the config's own keys are identifiers or list indices."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


_TYPE_TAGS = {"float", "int", "str", "bool", "dict", "list", "none"}


def _line(key: str, detail: dict) -> str:
    if detail["type"] == "missing":
        return f"{key}: required key is missing"
    message = detail["msg"].removeprefix("Value error, ")
    if detail["type"] != "value_error":
        message = f"{message} (got {detail['input']!r})"
    return f"{key}: {message}" if key else message
