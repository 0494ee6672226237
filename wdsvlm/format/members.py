"""A sample's media members: which of its members are images, which are videos, and in what
order, by one rule that the writer, ``wdsvlm index`` and the reader share.

A member is a medium by the last extension of its suffix (in any case): an image
(``IMAGE_EXTENSIONS``) or a video (``VIDEO_EXTENSIONS``: a container, or ``frames``, a video
given as its frames' image files and stored as a tar of them). Per kind, a sample names its
media one of three ways:

- numbered, ``0.jpg``, ``1.mp4``, ...: what the writer writes (``media_name``: one number per
  medium, in the order of the conversation's markers, images and videos counted together); a
  kind's members come in number order;
- bare, ``jpg`` or ``mp4``: the one medium of its kind (``KEY.jpg`` as img2dataset writes it,
  ``KEY.mp4`` as LLaVA-Video style tars hold it);
- dotted, ``edited.jpg``: where a kind has neither, its one member whose last extension is the
  kind's, as webdataset's decoders read it (beside a bare or numbered one it is no medium).

Anything else is refused (``BadSample``, ``ambiguous_images`` / ``ambiguous_videos``): bare and
numbered members of one kind, two bare or two dotted ones, two numbered ones of one number.
Members of other extensions (``json``, ``txt``, ``0.txt``) are no media.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

IMAGE = "image"
VIDEO = "video"
# Video members are stored as their original bytes under their container's extension; a video
# given as its frames' image files is stored as a tar of those files, as they are (``frames``).
FRAMES = "frames"
VIDEO_EXTENSIONS = ("mp4", "mov", "m4v", "mkv", "webm", "avi", FRAMES)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
_EXTENSIONS = {IMAGE: IMAGE_EXTENSIONS, VIDEO: VIDEO_EXTENSIONS}
_NUMBERED = re.compile(r"(\d+)\.([A-Za-z0-9]+)")


class BadSample(ValueError):
    """A sample's members do not make a sample of its layout; ``reason`` is a short code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Media:
    """A sample's media members (suffixes), each kind in its order."""

    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()


def media_kind(suffix: str) -> str | None:
    """``IMAGE`` or ``VIDEO`` as the suffix's last extension says, None for other members."""
    ext = suffix.rsplit(".", 1)[-1].lower()
    return next((kind for kind, exts in _EXTENSIONS.items() if ext in exts), None)


def media_number(suffix: str) -> int | None:
    """The number of a numbered medium (``3.png``: 3), None for a bare or dotted one."""
    match = _NUMBERED.fullmatch(suffix)
    return int(match.group(1)) if match else None


def media_name(number: int, ext: str) -> str:
    """The suffix the writer gives the sample's ``number``-th medium stored as ``ext``."""
    return f"{number}.{ext}"


def members_of_kind(suffixes: Iterable[str], kind: str) -> list[str]:
    """The members of ``kind`` among ``suffixes``, in order (see the module); ``BadSample``
    where the rule cannot tell which they are."""
    exts = _EXTENSIONS[kind]
    bare, numbered, dotted = [], [], []
    for s in suffixes:
        if not isinstance(s, str) or media_kind(s) != kind:
            continue
        number = media_number(s)
        if number is not None:
            numbered.append((number, s))
        elif s.lower() in exts:
            bare.append(s)
        else:
            dotted.append(s)
    plural = f"{kind}s"
    if bare and numbered or len(bare) > 1:
        example = "jpg" if kind == IMAGE else "mp4"
        raise BadSample(
            f"ambiguous_{plural}",
            f"{kind} members {sorted(bare + [s for _, s in numbered])}: either one bare {kind} "
            f"suffix ({example}) or numbered ones (0.{example}, 1.{example})",
        )
    numbered.sort()
    if len({n for n, _ in numbered}) != len(numbered):
        raise BadSample(
            f"ambiguous_{plural}", f"two {plural} share a number: {[s for _, s in numbered]}"
        )
    if bare or numbered:
        return bare or [s for _, s in numbered]
    if len(dotted) > 1:
        raise BadSample(
            f"ambiguous_{plural}",
            f"members {sorted(dotted)} are each {'an' if kind == IMAGE else 'a'} {kind} and none "
            f"is named plainly ({exts[0]}) or numbered: which one is meant is not clear",
        )
    return dotted


def media_members(suffixes: Iterable[str]) -> Media:
    """A sample's images and videos among its members' ``suffixes`` (see the module);
    ``BadSample`` where the rule cannot tell which they are."""
    suffixes = list(suffixes)
    return Media(tuple(members_of_kind(suffixes, IMAGE)), tuple(members_of_kind(suffixes, VIDEO)))


def read_members(sample: Mapping, kind: str) -> list[str]:
    """``members_of_kind`` of a sample as the reader holds it (its members by suffix beside
    the pipeline's own fields). Where the rule refuses them, none: ``wdsvlm index`` and the
    writer refuse such a sample, so its tar changed since it was indexed, and the stage that
    asks counts the sample as not matching its index."""
    try:
        return members_of_kind(sample, kind)
    except BadSample:
        return []
