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
    """One line per pydantic error, located by its dotted key under `prefix`."""
    lines = []
    for detail in error.errors(include_url=False):
        key = join_key(prefix, ".".join(str(part) for part in detail["loc"]))
        if detail["type"] == "missing":
            lines.append(f"{key}: required key is missing")
            continue
        message = detail["msg"].removeprefix("Value error, ")
        if detail["type"] != "value_error":
            message = f"{message} (got {detail['input']!r})"
        lines.append(f"{key}: {message}" if key else message)
    return lines
