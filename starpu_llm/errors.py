"""One exception type for bad input: the CLI prints its message and exits with status 2."""


class StarpuLLMError(Exception):
    """A user-facing error: the message names the file or flag and says what to do."""
