"""One exception type per kind of failure a user can act on.

Every message names the thing at fault (file, record, shard, key or URL) and, where there is
one, the fix.
"""

from __future__ import annotations


class WdsvlmError(Exception):
    """Base class of every error wdsvlm raises on purpose."""


class InputError(WdsvlmError):
    """An input record of the writer is bad (invalid JSON, missing image, ...).

    ``where`` names the record (file, line or position, id), ``reason`` is a short code that
    skip counts are grouped by.
    """

    def __init__(self, where: str, reason: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.reason = reason
        self.message = message

    def __reduce__(self):  # cross process boundaries with all three fields
        return (type(self), (self.where, self.reason, self.message))


class BadInputError(WdsvlmError):
    """The writer found bad records and was not asked to skip them; nothing was written."""

    def __init__(self, errors: list[InputError], total: int, shown: int = 10):
        lines = [str(e) for e in errors[:shown]]
        more = f"\n  ... and {len(errors) - shown} more" if len(errors) > shown else ""
        super().__init__(
            f"{len(errors)} of {total} input records are bad; nothing was written "
            "(pass --skip-bad / skip_bad=True to skip them and list them in skipped.jsonl):\n  "
            + "\n  ".join(lines)
            + more
        )
        self.errors = errors


class ShardFormatError(WdsvlmError):
    """A dataset, shard or index does not follow the wdsvlm shard format."""


class StorageError(WdsvlmError):
    """Reading from or writing to a file or bucket failed."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A file or object that is not there (a permanent fault: never retried)."""


class DatasetExistsError(WdsvlmError):
    """The writer's output already holds a dataset and overwriting was not asked for."""


class TooManyFailuresError(WdsvlmError):
    """So many samples failed in a row that the fault is systematic, not a few bad samples."""


class TemplateError(WdsvlmError):
    """A chat template does not render a conversation in a way the label mask can follow."""
