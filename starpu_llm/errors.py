"""One exception type for bad input: the CLI prints its message and exits with status 2.

Below the CLI, errors and warnings speak the library's terms: a training setting is named
through opt("batch"), a TrainConfig field, which reads as that field ("batch 12 ...") to a
Python caller and as its flag ("--batch 12 ...") in the CLI's message (render).
"""
import re

_MARK = "\x1f"


def opt(name: str) -> str:
    """A TrainConfig field named in an error message (rendered as the field or its flag)."""
    return f"{_MARK}{name}{_MARK}"


def flag(name: str) -> str:
    """The CLI flag of a TrainConfig field."""
    return "--" + name.replace("_", "-")


def render(text: str, name=lambda field: field) -> str:
    """text with each setting named through opt() written as name(field) (flag for the CLI;
    a warning as an error)."""
    return re.sub(f"{_MARK}(\\w+){_MARK}", lambda m: name(m.group(1)), text)


class StarpuLLMError(Exception):
    """A user-facing error: the message names the file or setting and says what to do."""

    def render(self, name=lambda field: field) -> str:
        """The message, each setting written as name(field) (flag for the CLI)."""
        return render(str(self.args[0]), name)

    def __str__(self) -> str:
        return self.render()
