"""What lets the families' processors be built for images only, without torchvision."""

from __future__ import annotations

from typing import Any

from transformers.video_processing_utils import VideoProcessorMixin


class ImagesOnlyVideoProcessor(VideoProcessorMixin):
    """Stands in for the video processor of an images-only processor.

    Qwen2/2.5/3-VL and SmolVLM processors take a video processor, and every real one subclasses
    ``BaseVideoProcessor``, which needs torchvision. This one has the attributes the processors
    read outside the video path (SmolVLM's ``apply_chat_template`` reads ``num_frames`` and
    ``fps`` for every conversation) and refuses videos with a clear error.
    """

    def __call__(self, videos: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("tiny processors handle images only (no video processor)")


class ImagesOnly:
    """Lets a processor be built with an ``ImagesOnlyVideoProcessor`` without torchvision.

    ``ProcessorMixin.__init__`` checks each sub-processor's class by looking its base class's
    name up in the top-level ``transformers`` namespace, which exports ``VideoProcessorMixin``
    only when torchvision imports (transformers 5.24); otherwise the check fails with an
    AttributeError whatever is passed, ``None`` included. This does the same isinstance check
    against the class itself.
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor":
            if not isinstance(argument, VideoProcessorMixin):
                raise TypeError(
                    f"Received a {type(argument).__name__} for argument video_processor, "
                    "but a VideoProcessorMixin was expected."
                )
            return VideoProcessorMixin
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[misc]
