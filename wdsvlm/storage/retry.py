"""How a request to a store is asked again: which errors are faults worth a retry, which are
the store asking to slow down (throttling), and the loop that tells them apart.

A fault (a cut connection, a 500, a stalled answer) is retried ``ReadPolicy.attempts`` times
with a backoff. Throttling (429, S3's ``503 SlowDown`` and their kin, or any answer with a
``Retry-After``) is no fault: the request waits as long as the store asks (``Retry-After``),
else a backoff with jitter, the node's request rate is lowered (``storage.governor``), and it
is asked again, without using up the fault retries, for at most ``ReadPolicy.throttle_wait``
seconds in all.
"""

from __future__ import annotations

import email.utils
import errno
import logging
import random
import re
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import ObjectNotFoundError, StorageError
from . import governor

log = logging.getLogger("wdsvlm.storage")


@dataclass(frozen=True)
class ReadPolicy:
    """How ranged reads fetch bytes and live through network faults."""

    block_bytes: int = 4 * 2**20
    """Bytes fetched per request; a request that breaks is tried again from its first byte."""
    attempts: int = 6
    """Tries of one block before giving up on a transient error (permanent ones: at once)."""
    backoff: float = 0.1
    """Seconds before the first retry; doubled each time, with jitter, up to ``max_backoff``."""
    max_backoff: float = 5.0
    timeout: float = 60.0
    """Seconds one request may take (a stalled one then counts as a transient failure)."""
    throttle_wait: float = 300.0
    """Seconds one request may go on being throttled (429, 503 SlowDown: asked again as the
    store says, without using up ``attempts``) before ``StorageError``."""
    requests_per_second: float | None = None
    """The most requests a second the processes of one node send together (None: no cap);
    shared through a file in ``node_dir``."""
    node_dir: str | None = None
    """A node-local folder for what the node's processes share (the shard table's copy, the
    request budget); None: the Loader's ``local_dir``, else the cache folder, else a
    temporary folder (``storage.folders.node_folder``)."""
    node_bytes: int | None = None
    """Bytes the copies of the shards' sidecars may take in ``node_dir`` (the least recently
    used removed first; 0: none kept, each process reads them from the store); None: the
    Loader's ``local_bytes``, else ``storage.node.LOCAL_BYTES``."""

    def __post_init__(self):
        cap = self.requests_per_second
        wrong = self.block_bytes < 1 or self.attempts < 1 or self.timeout <= 0
        if wrong or self.throttle_wait < 0 or (cap is not None and not cap > 0):
            raise ValueError(f"invalid read policy: {self}")


class RequestCounts:
    """What reads asked of a store, added up (thread-safe; pickles as its figures):
    ``requests`` sent (every try), ``bytes`` received, ``throttled`` answers (503 SlowDown,
    429, ...) and ``retries`` after faults; and ``seconds``, the requests' own time (from
    asking to the answer, without waiting for a turn or a backoff), summed over the threads
    that made them, and ``cache_hits``, ranges the shard cache served with no request."""

    COUNTS = ("requests", "bytes", "throttled", "retries")
    FIELDS = (*COUNTS, "cache_hits", "seconds")

    def __init__(self, **counts: float):
        self._lock = threading.Lock()
        self.requests = self.bytes = self.throttled = self.retries = self.cache_hits = 0
        self.seconds = 0.0
        self.add(**counts)

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                if name not in self.FIELDS:
                    raise ValueError(f"{name} is not one of {self.FIELDS}")
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        """The counts (``COUNTS``): what the store was asked and sent."""
        with self._lock:
            return {name: getattr(self, name) for name in self.COUNTS}

    def figures(self) -> dict[str, float]:
        """The counts, the requests' ``seconds`` and the ``cache_hits`` (``FIELDS``)."""
        with self._lock:
            return {name: getattr(self, name) for name in self.FIELDS}

    def __getstate__(self):
        return self.figures()

    def __setstate__(self, state):
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"RequestCounts({self.as_dict()})"


# Error codes of answers that will not change by asking again (matched as whole words in the
# message, never in a URL: a shard may well be called data-000404.tar).
_PERMANENT = re.compile(
    r"\b(NoSuchBucket|NoSuchKey|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|"
    r"AllAccessDisabled|AccountProblem|InvalidBucketName)\b"
)

# What stores say when they throttle: S3's SlowDown (its reason phrase "Slow Down", s3fs's
# "reduce your request rate"), the codes of botocore's throttling retry policies, GCS's
# rateLimitExceeded.
_THROTTLING = re.compile(
    r"\b(SlowDown|Slow Down|Throttling|ThrottlingException|ThrottledException|"
    r"RequestLimitExceeded|TooManyRequests|Too Many Requests|RequestThrottled|"
    r"RequestThrottledException|ProvisionedThroughputExceededException|rateLimitExceeded|"
    r"userRateLimitExceeded|reduce your request rate)\b"
)

# errno values of an OSError that asking again will not change: s3fs turns a 400, an invalid
# range or argument into EINVAL, a 501 into ENOSYS and a redirect to another region into EREMCHG.
_PERMANENT_ERRNO = {
    errno.EINVAL,
    errno.ENOSYS,
    errno.EPERM,
    errno.EACCES,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
    getattr(errno, "EREMCHG", errno.ENOENT),
}

# Network faults of the HTTP clients under fsspec's backends that are not OSErrors, by module
# and class name: a cut or stalled connection, a body cut short. Looked up only among modules
# already imported (an error cannot come from one that is not), so no backend is imported here.
_NETWORK_ERRORS = {
    "aiohttp": ("ClientConnectionError", "ClientPayloadError"),
    "botocore.exceptions": ("HTTPClientError", "ResponseParserError"),
    "urllib3.exceptions": ("ProtocolError", "TimeoutError"),
    "http.client": ("IncompleteRead", "BadStatusLine"),
}


def _network_error(error: BaseException) -> bool:
    for module, names in _NETWORK_ERRORS.items():
        found = sys.modules.get(module)
        kinds = tuple(k for k in (getattr(found, n, None) for n in names) if isinstance(k, type))
        if kinds and isinstance(error, kinds):
            return True
    return False


def http_status(error: BaseException) -> int | None:
    """The HTTP status of an error that carries one: ``status`` (aiohttp, fsspec's HTTP), an
    int ``code`` (gcsfs), a botocore ``response`` or an HTTP client's ``response.status_code``
    (the Hub's)."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    code = getattr(error, "code", None)
    if isinstance(code, int) and 100 <= code < 600:
        return code
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it was raised from (s3fs keeps botocore's answer as the cause)."""
    chain: list[BaseException] = []
    while error is not None and len(chain) < 8 and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _headers(error: BaseException):
    """The answer's headers, where the error keeps them (aiohttp, botocore, HTTP clients)."""
    headers = getattr(error, "headers", None)
    response = getattr(error, "response", None)
    if headers is None and isinstance(response, dict):
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders")
    if headers is None and response is not None:
        headers = getattr(response, "headers", None)
    return headers if hasattr(headers, "get") else None


def retry_after(error: BaseException) -> float | None:
    """The seconds the store asks to wait (its ``Retry-After``, in seconds or as a date), or
    None where the answer does not say."""
    for e in _causes(error):
        headers = _headers(e)
        value = headers.get("Retry-After", headers.get("retry-after")) if headers else None
        if value is None:
            continue
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
            except (TypeError, ValueError):
                return None
    return None


def is_throttling(error: BaseException) -> bool:
    """Whether the store asks to slow down: a 429, a 503 that names a throttling code (S3's
    SlowDown) or carries a ``Retry-After``, or a throttling code of botocore or GCS. A bare
    503 (a store that is down) is a fault, not throttling."""
    for e in _causes(error):
        status = http_status(e)
        if status == 429:
            return True
        response = getattr(e, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        text = " ".join(str(a) for a in (code, *getattr(e, "args", ())) if a)
        text += " " + str(getattr(e, "message", ""))
        if (status in (None, 503) or code) and _THROTTLING.search(text):
            return True
        if status == 503 and retry_after(e) is not None:
            return True
    return False


def is_transient(error: BaseException) -> bool:
    """Whether asking again may succeed: connection resets and refusals, timeouts, throttling
    and 5xx answers yes; missing objects or buckets, refused access, bad requests no.

    Only what is known to be a fault of the network or the store is transient: any other
    exception (a ``TypeError``, ``KeyError``, ... of a bug) is not, so it surfaces at once
    instead of after every retry."""
    if isinstance(
        error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
    ):
        return False
    status = http_status(error)
    if status is not None:  # an HTTP answer: its status decides
        return status in (408, 429) or status >= 500
    if isinstance(error, (ConnectionError, TimeoutError)) or _network_error(error):
        return True
    if not isinstance(error, OSError):  # not a fault of I/O: a bug, surfaced at once
        return False
    if error.errno in _PERMANENT_ERRNO:
        return False
    # the other OSErrors: what the backends make of the store's answers (s3fs: a 503 or
    # SlowDown as EBUSY, a 500 as EREMOTEIO, an unknown code as EIO), unless a code says no
    text = " ".join(str(a) for a in getattr(error, "args", ()) if not str(a).startswith("http"))
    return not _PERMANENT.search(text)


def _pause(seconds: float, cancel: threading.Event | None) -> None:
    if cancel is not None:
        cancel.wait(seconds)
    else:
        time.sleep(seconds)


def _throttled_too_long(url, at, since, throttles, policy, cause, error=None):
    raise StorageError(
        f"{url}: throttled for {time.monotonic() - since:.1f} s at byte {at} "
        f"({throttles} answers; throttle_wait={policy.throttle_wait:g} s); "
        f"last: {cause}; lower requests_per_second or the number of readers"
    ) from error


def retrying(
    url: str,
    at: int,
    request,
    policy: ReadPolicy,
    cancel: threading.Event | None,
    counts: RequestCounts | None = None,
):
    """``request()``, in its turn of the node's request budget (``governor.turn``), asked again
    while it fails with a transient error: after a backoff with jitter, ``policy.attempts``
    tries in all for faults; as long as the store asks and at most ``policy.throttle_wait``
    seconds for throttling. A permanent error of the store raises ``StorageError``
    (``ObjectNotFoundError`` for a missing object) naming ``url`` and the byte ``at``; any
    other exception (a bug) is raised as it is, at once."""
    failures = throttles = 0
    throttled_since = 0.0
    cause = ""
    while True:
        if cancel is not None and cancel.is_set():
            raise StorageError(f"{url}: read cancelled at byte {at}")
        # a throttled request waits for its turn within what is left of throttle_wait
        left = policy.throttle_wait - (time.monotonic() - throttled_since) if throttles else None
        if not governor.turn(url, policy.node_dir, policy.requests_per_second, cancel, left):
            _throttled_too_long(url, at, throttled_since, throttles, policy, cause)
        if counts is not None:
            counts.add(requests=1)
        began = time.perf_counter()
        try:
            answer = request()
        except Exception as e:  # noqa: BLE001 - classified below; every path re-raises or retries
            if counts is not None:  # the failed request's own time, not the backoff's
                counts.add(seconds=time.perf_counter() - began)
            cause = f"{type(e).__name__}: {e}".strip()
            if is_throttling(e):
                now = time.monotonic()
                throttled_since = throttled_since or now
                throttles += 1
                if counts is not None:
                    counts.add(throttled=1)
                governor.throttled(url, policy.node_dir)
                # the governor paces the node already: a short wait of its own, with jitter
                wait = min(1.0, policy.backoff * 2 ** (throttles - 1)) * (0.5 + random.random())
                asked = retry_after(e)
                wait = max(wait, asked or 0.0)  # never sooner than the store asks
                if now - throttled_since + wait > policy.throttle_wait:
                    _throttled_too_long(url, at, throttled_since, throttles, policy, cause, e)
                log.info("%s: throttled at byte %d, again in %.2f s (%s)", url, at, wait, cause)
                _pause(wait, cancel)
                continue
            if not is_transient(e):
                if not (isinstance(e, OSError) or http_status(e) is not None):
                    # not the store's answer but a bug (or a fault of no known kind): as it
                    # is, so that on_shard_error="skip" cannot count it as an unreadable shard
                    if hasattr(e, "add_note"):  # Python 3.11+
                        e.add_note(f"while reading {url} from byte {at}")
                    raise
                kind = ObjectNotFoundError if isinstance(e, FileNotFoundError) else StorageError
                raise kind(f"{url}: cannot read from byte {at}: {cause}") from e
            failures += 1
            if failures >= policy.attempts:
                raise StorageError(
                    f"{url}: gave up at byte {at} after {failures} attempts; last: {cause}"
                ) from e
            if counts is not None:
                counts.add(retries=1)
            log.info("%s: retrying from byte %d (%s)", url, at, cause)
            wait = min(policy.max_backoff, policy.backoff * 2 ** (failures - 1))
            _pause(wait * (0.5 + random.random()), cancel)
            continue
        if counts is not None:
            counts.add(seconds=time.perf_counter() - began)
        return answer
