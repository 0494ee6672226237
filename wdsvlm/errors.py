"""One exception type per kind of failure a user can act on.

Every message names the thing at fault (file, record, shard, key or URL) and, where there is
one, the fix.
"""

from __future__ import annotations


class WdsvlmError(Exception):
    """Base class of every error wdsvlm raises on purpose."""


class InputError(WdsvlmError):
    """An input record of the writer, or a sample of a tar being indexed, is bad (invalid
    JSON, missing image, ...).

    ``where`` names the record (file, line or position, id) or sample (shard and key),
    ``reason`` is a short code that skip counts are grouped by. ``fields`` names it in the
    list of skipped ones where ``where`` alone would not do (a tar sample: its ``shard`` and
    ``key``); by default that list says ``where``.
    """

    def __init__(self, where: str, reason: str, message: str, fields: dict[str, str] | None = None):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.reason = reason
        self.message = message
        self.fields = dict(fields) if fields else {"where": where}

    def __reduce__(self):  # cross process boundaries with every field
        return (type(self), (self.where, self.reason, self.message, self.fields))

    def listed(self) -> dict:
        """Its line in the list of skipped records or samples."""
        return {**self.fields, "reason": self.reason, "message": self.message}


class BadInputError(WdsvlmError):
    """Bad input records (``wdsvlm write``) or tar samples (``wdsvlm index``) were found
    and skipping them was not asked for: the run stopped without its index.

    ``errors`` holds each one's ``InputError``; the message names the first ``shown`` of them
    with their reasons. ``items`` says what was read (``input records``, ``samples``),
    ``outcome`` what that left and how to go on.
    """

    def __init__(
        self,
        errors: list[InputError],
        total: int,
        *,
        items: str,
        outcome: str,
        shown: int = 10,
    ):
        lines = [f"{e.where}: {e.message} ({e.reason})" for e in errors[:shown]]
        more = f"\n  ... and {len(errors) - shown} more" if len(errors) > shown else ""
        super().__init__(
            f"{len(errors)} of {total} {items} are bad; {outcome}:\n  " + "\n  ".join(lines) + more
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
