"""One exception type for bad input: the CLI prints its message and exits with status 2.

Below the CLI, errors speak the library's terms: a training setting is named through
opt("batch"), a TrainConfig field, which reads as that field ("batch 12 ...") to a Python
caller and as its flag ("--batch 12 ...") in the CLI's message (StarpuLLMError.render).
"""
import re

_MARK = "\x1f"


def opt(name: str) -> str:
    """A TrainConfig field named in an error message (rendered as the field or its flag)."""
    return f"{_MARK}{name}{_MARK}"


def flag(name: str) -> str:
    """The CLI flag of a TrainConfig field."""
    return "--" + name.replace("_", "-")


class StarpuLLMError(Exception):
    """A user-facing error: the message names the file or setting and says what to do."""

    def render(self, name=lambda field: field) -> str:
        """The message, each setting written as name(field) (flag for the CLI)."""
        return re.sub(f"{_MARK}(\\w+){_MARK}", lambda m: name(m.group(1)), str(self.args[0]))

    def __str__(self) -> str:
        return self.render()
