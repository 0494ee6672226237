"""Sample layouts: how the members of a WebDataset sample make a conversation.

wdsvlm reads three layouts, and an index records which one its shards hold:

- ``wdsvlm``: its own (``KEY.json`` with ``messages``, images ``KEY.0.jpg``, ``KEY.1.png``...).
- ``captions``: an image member and a text member (``KEY.jpg`` + ``KEY.txt``, as img2dataset
  writes them). The conversation is user: the image and a prompt, assistant: the caption. The
  prompt is picked per key from a list by a seeded hash, so the same key always gets it.
- ``conversations``: a JSON member holding LLaVA-style ``conversations``, Cauldron-style
  ``texts`` or ``messages`` with roles, with the sample's image members.
- ``mint1t``: MINT-1T's tars as published (``KEY.json`` with parallel ``texts`` and ``images``
  lists, ``KEY.tiff`` with the images as frames), each sample a document (``mint1t.py``).

With ``kind="caption"`` the captions layout makes each sample a caption instead (its images,
then the caption; ``format/documents.py``), trained on without a prompt.

Keys and suffixes follow webdataset: a member's key is its path up to the first dot of its
base name, the rest is its suffix (``000005.edited.jpg``: key ``000005``, suffix
``edited.jpg``); suffixes match case-insensitively. A sample's images and videos are found by
``members``' one rule (its one bare ``jpg`` / ``mp4``, or its numbered ones ``0.jpg``,
``1.mp4`` ... in number order), which the reader of wdsvlm's own layout follows too; its text
and JSON members are the ones of those suffixes. Where no member has such a suffix, a member
plays the part its last extension names, as webdataset's decoders read it (``edited.jpg`` an
image, ``edited.txt`` a caption, ``edited.json`` the JSON), if it is the only one of that kind
(two ``*.jpg`` then: ``ambiguous_images``). Other members are left alone.

``Layout.convert`` turns a sample's members into wdsvlm's own (``json`` and ``0.jpg``...), which
is what the reader hands the rest of the pipeline, so every stage reads one layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from .conversation import IMAGE_MARKER, conversation_of, media_order, place_images
from .documents import KINDS, document_json
from .members import BadSample, media_members, media_name, media_number
from .mint1t import Document, is_mint1t
from .mint1t import document as mint1t_document

LAYOUTS = ("wdsvlm", "captions", "conversations", "mint1t")
TEXT_SUFFIXES = ("txt", "caption", "text", "cap")
"""The captions layout's text member: the first of these a sample has."""
DEFAULT_PROMPTS = (
    "Describe the image.",
    "What does this image show?",
    "Write a short caption for the image.",
    "Describe this picture briefly.",
    "What is in this image?",
)
"""The captions layout's prompts unless others are given."""


def split_name(name: str) -> tuple[str, str]:
    """``(key, suffix)`` of a tar member name, as webdataset splits it."""
    folder, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix


def image_extension(suffix: str) -> str:
    ext = _last_extension(suffix)
    return "jpg" if ext == "jpeg" else ext


def find_member(suffixes: Sequence[str], names: Sequence[str], kind: str) -> str | None:
    """The member playing the part of ``names`` (suffixes, the first found wins): the one
    whose suffix is one of them, else the only one whose last extension is (see the module);
    ``None`` if there is none. ``kind`` names the part in the ``BadSample`` of two such
    (``ambiguous_{kind}``)."""
    lowered = {s.lower(): s for s in suffixes}
    found = next((lowered[n] for n in names if n in lowered), None)
    if found is not None:
        return found
    for name in names:
        dotted = _by_last_extension(suffixes, (name,), kind)
        if dotted:
            return dotted[0]
    return None


def _by_last_extension(suffixes: Sequence[str], names: Sequence[str], kind: str) -> list[str]:
    """The one dotted suffix (``edited.jpg``) whose last extension is among ``names``, as a
    list (empty if there is none); ``BadSample`` if there are more."""
    dotted = [s for s in suffixes if "." in s and _last_extension(s) in names]
    if len(dotted) > 1:
        raise BadSample(
            f"ambiguous_{kind}",
            f"members {sorted(dotted)} each end in {'/'.join(names)} and none is named "
            f"{names[0]} plainly: which one is meant is not clear",
        )
    return dotted


def _last_extension(suffix: str) -> str:
    return suffix.rsplit(".", 1)[-1].lower()


@dataclass(frozen=True)
class Layout:
    """A sample layout and its settings; ``to_dict`` is what the index records."""

    name: str = "wdsvlm"
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    """captions: the user turn's text, one picked per key."""
    seed: int = 0
    """captions: the seed of the per-key pick."""
    text: tuple[str, ...] = field(default=TEXT_SUFFIXES)
    """captions: suffixes of the text member, the first found is the caption."""
    kind: str = ""
    """What a sample becomes (``documents.KINDS``): captions, ``conversation`` (default) or
    ``caption``; mint1t, ``document``; the others, ``conversation``."""

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {self.name!r}")
        kinds = {"captions": ("conversation", "caption"), "mint1t": ("document",)}
        allowed = kinds.get(self.name, ("conversation",))
        object.__setattr__(self, "kind", self.kind or allowed[0])
        if self.kind not in allowed:
            raise ValueError(
                f"the {self.name} layout makes {' or '.join(allowed)} samples, not {self.kind!r}"
                + (f" (one of {', '.join(KINDS)})" if self.kind not in KINDS else "")
            )
        if not self.prompts or not all(isinstance(p, str) and p.strip() for p in self.prompts):
            raise ValueError("prompts must be a non-empty list of non-empty strings")
        object.__setattr__(self, "prompts", tuple(self.prompts))
        object.__setattr__(self, "text", tuple(t.lower() for t in self.text))

    def to_dict(self) -> dict:
        if self.name == "captions" and self.kind == "caption":
            return {"name": self.name, "kind": self.kind, "text": list(self.text)}
        if self.name == "captions":
            return {
                "name": self.name,
                "prompts": list(self.prompts),
                "seed": self.seed,
                "text": list(self.text),
            }
        return {"name": self.name}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Layout:
        if not d:
            return cls()
        return cls(
            name=d["name"],
            prompts=tuple(d.get("prompts", DEFAULT_PROMPTS)),
            seed=int(d.get("seed", 0)),
            text=tuple(d.get("text", TEXT_SUFFIXES)),
            kind=d.get("kind", ""),
        )

    @property
    def native(self) -> bool:
        return self.name == "wdsvlm"

    def prompt(self, key: str) -> str:
        """The captions prompt of ``key``: the same for the same key, seed and prompts."""
        digest = hashlib.blake2b(f"{self.seed}\0{key}".encode(), digest_size=8).digest()
        return self.prompts[int.from_bytes(digest, "little") % len(self.prompts)]

    def caption(self, members: Mapping[str, bytes], n_images: int) -> str:
        """captions: the sample's caption; ``BadSample`` if there is none or no image."""
        found = find_member(list(members), self.text, "text")
        if found is None:
            raise BadSample(
                "missing_text",
                f"no caption member ({' or '.join(self.text)}) beside {sorted(members)}",
            )
        caption = _text(members[found], found).strip()
        if not caption:
            raise BadSample("missing_text", f"its {found} member is empty")
        if not n_images:
            raise BadSample("missing_image", f"no image member among {sorted(members)}")
        return caption

    def messages(
        self, key: str, members: Mapping[str, bytes], n_images: int, n_videos: int = 0
    ) -> list[dict]:
        """The sample's conversation, ``<image>`` and ``<video>`` markers in place;
        ``BadSample`` if there is none."""
        if self.name == "captions":
            caption = self.caption(members, n_images)
            prompt = IMAGE_MARKER * n_images + "\n" + self.prompt(key)
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": caption}]
        found = find_member(list(members), ("json",), "json")
        if found is None:
            raise BadSample("missing_json", f"no json member among {sorted(members)}")
        try:
            doc = json.loads(_text(members[found], found))
        except json.JSONDecodeError as e:
            raise BadSample("invalid_json", f"its json member is not JSON: {e}") from None
        try:
            messages = conversation_of(doc, key)
            place_images(messages, n_images, key, n_videos=n_videos)
        except InputError as e:
            raise BadSample(e.reason, e.message) from None
        return messages

    def document(self, key: str, members: Mapping[str, bytes]) -> Document:
        """The document or caption (``kind``) a sample of this layout makes, given its
        members by suffix, with the images it leaves out; ``BadSample`` if they make none."""
        if self.name == "mint1t":
            return mint1t_document(key, members)
        images = media_members(members).images
        elements = [{"image": n} for n in range(len(images))]
        elements.append({"text": self.caption(members, len(images))})
        out = {"json": document_json(key, self.kind, elements)}
        for n, suffix in enumerate(images):
            out[media_name(n, image_extension(suffix))] = members[suffix]
        return Document(out, elements)

    def convert(self, key: str, members: Mapping[str, bytes]) -> dict[str, bytes]:
        """wdsvlm's own members (``json``, ``0.jpg``...) for a sample of this layout, given
        its members by suffix; ``BadSample`` if they do not make one."""
        if self.native:
            return dict(members)
        if self.kind != "conversation":
            return self.document(key, members).members
        media = media_members(members)
        messages = self.messages(key, members, len(media.images), len(media.videos))
        out = {"json": canonical_json(key, messages)}
        files = {"image": iter(media.images), "video": iter(media.videos)}
        order = media_order(messages, len(media.images), len(media.videos))
        for n, kind in enumerate(order):  # numbered in the placeholders' order
            suffix = next(files[kind])
            out[media_name(n, image_extension(suffix))] = members[suffix]
        return out


def canonical_json(key: str, messages: list[dict], source: str = "") -> bytes:
    doc = {"id": key, "source": source, "messages": messages}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _text(data: bytes, suffix: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadSample("invalid_text", f"its {suffix} member is not UTF-8: {e}") from None


def detect(samples: Sequence[Mapping[str, bytes]]) -> tuple[str, str]:
    """The layout of samples given by their members (suffix -> bytes), and why: what was
    found in them. Raises ``ValueError`` when no layout fits."""
    for members in samples:
        suffixes = list(members)
        try:
            media = media_members(suffixes)
            text = find_member(suffixes, TEXT_SUFFIXES, "text")
            found = find_member(suffixes, ("json",), "json")
        except BadSample:
            continue
        if found is not None:
            try:
                doc = json.loads(members[found])
            except (json.JSONDecodeError, UnicodeDecodeError):
                doc = None
            if isinstance(doc, dict):
                if is_mint1t(doc):
                    return "mint1t", "a json member with parallel 'texts' and 'images' lists"
                own = "messages" in doc or ("kind" in doc and "elements" in doc)
                if own and "id" in doc and "source" in doc and "." not in found:
                    # as the writer names them; bare ones (KEY.mp4) are converted
                    numbered = all(media_number(s) is not None for s in media.images + media.videos)
                    if numbered:
                        what = "messages" if "messages" in doc else "kind/elements"
                        return "wdsvlm", f"a json member with wdsvlm's id/source/{what}"
                for field_ in ("conversations", "texts", "messages"):
                    if field_ in doc:
                        return "conversations", f"a json member with '{field_}'"
        if text and media.images:
            image = media.images[0]
            return "captions", f"an image member ({image}) and a text member ({text})"
    raise ValueError(
        "cannot tell the layout of these samples: no json member with 'conversations', "
        "'texts' or 'messages' (or MINT-1T's 'texts' and 'images'), and no image member "
        "beside a text member "
        f"({'/'.join(TEXT_SUFFIXES)}); pass --format"
    )
