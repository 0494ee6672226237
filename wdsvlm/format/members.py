"""The extensions of a sample's video members, known to both the image and the video readers
(so that a video is never taken for an image)."""

from __future__ import annotations

# Video members are stored as their original bytes under their container's extension; a video
# given as its frames' image files is stored as a tar of those files, as they are (``frames``).
FRAMES = "frames"
VIDEO_EXTENSIONS = ("mp4", "mov", "m4v", "mkv", "webm", "avi", FRAMES)
