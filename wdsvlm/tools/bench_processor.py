"""``wdsvlm bench --processor``: the Loader with a model family's processor beside the naive
way of feeding that model, on the same samples.

The naive way is what a first loader for a Hugging Face VLM usually is: webdataset's tar
reader and, per sample, a PIL decode of its images (``open_image``, as the Loader decodes
them), the processor's chat template and the processor itself
(``processor(text=[text], images=[images])``: resize, rescale, normalise, patches, and the
tokenizer), labels by masking everything but the assistant turns, samples over
``max_length`` tokens dropped, and batches of ``batch_size`` samples padded to the longest,
with the processor's float32 ``pixel_values`` concatenated, all in a torch DataLoader with
the same workers as the Loader. The Loader ships uint8 units instead and its batches are
normalised by ``wdsvlm.model_inputs`` inside the timing, as a training loop would (here on
the CPU), so that the normalisation is counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..families.hf_processor import conversation
from ..families.registry import load_processor
from ..format.images import image_members, open_image
from ..pipeline.tokenize import IGNORE_INDEX
from .bench import bench_table, side_by_side
from .naive import webdataset_batches

# The image sizes each family's checkpoints are published with (``tiny:FAMILY``): Qwen2-VL
# and Qwen2.5-VL as transformers' Qwen2VLImageProcessor defaults (56x56 to 1280 28x28 merged
# tokens), Qwen3-VL as its preprocessor_config.json (64 to 16384 32x32 merged tokens),
# SmolVLM-Instruct 384 px tiles of an image resized to 1536 px; Idefics3 publishes 364 px
# tiles, which the tiny processor's 16 px patches cannot take, so 384 px there too;
# LLaVA-OneVision 384 px views (729 tokens) and its grid of 1 to 6 views a side.
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}},
    "qwen2_5_vl": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}},
    "qwen3_vl": {"size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32}},
    "smolvlm": {"size": {"longest_edge": 4 * 384}, "max_image_size": {"longest_edge": 384}},
    "idefics3": {"size": {"longest_edge": 4 * 384}, "max_image_size": {"longest_edge": 384}},
    "llava_onevision": {
        "size": {"height": 384, "width": 384},
        "image_grid_pinpoints": [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)],
    },
}


def bench_processor(spec: Any) -> Any:
    """A processor object as is; ``"tiny:FAMILY"``: ``wdsvlm.testing.tiny.tiny_processor`` of
    the family with its published image sizes (so that the image work is real; the tokenizer
    is the tiny one shipped with ``wdsvlm.testing``, nothing is downloaded); otherwise a name
    or path for ``AutoProcessor``."""
    if isinstance(spec, str) and spec.startswith("tiny:"):
        from ..testing.tiny import FAMILIES, tiny_processor

        family = spec.removeprefix("tiny:")
        if family not in PUBLISHED:
            raise ValueError(f"unknown family {family!r} in {spec!r}; expected one of {FAMILIES}")
        return tiny_processor(family, **PUBLISHED[family])
    return load_processor(spec)


class AnswerLabels:
    """Labels the usual way: every token masked but the assistant turns, found in the ids by
    the template's assistant header (``<|im_start|>assistant\\n``, ``Assistant:``) and
    ended by its end-of-turn token (``<|im_end|>``, ``<end_of_utterance>``), which is
    supervised too. Both are read off the processor's own chat template."""

    def __init__(self, processor: Any):
        def render(messages: list[dict], prompt: bool = False) -> str:
            return processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )

        user = [{"role": "user", "content": [{"type": "text", "text": "Question?"}]}]
        answer = {"role": "assistant", "content": [{"type": "text", "text": "Answer."}]}
        head = render(user, prompt=True)[len(render(user)) :]
        whole = render([*user, answer])
        end = whole[whole.rindex("Answer.") + len("Answer.") :].strip()
        tokenizer = processor.tokenizer
        self.head = tokenizer(head, add_special_tokens=False)["input_ids"]
        self.end = tokenizer(end, add_special_tokens=False)["input_ids"][:1]
        if not self.head or not self.end:
            raise ValueError(
                f"cannot find the assistant turns of {type(processor).__name__}'s template"
            )

    def __call__(self, ids: list[int]) -> list[int]:
        labels = [IGNORE_INDEX] * len(ids)
        head, end, n = self.head, self.end[0], len(self.head)
        i = 0
        while i < len(ids):
            if ids[i : i + n] == head:
                start = stop = i + n
                while stop < len(ids) and ids[stop] != end:
                    stop += 1
                stop = min(stop + 1, len(ids))  # the end-of-turn token is supervised
                labels[start:stop] = ids[start:stop]
                i = stop
            else:
                i += 1
        return labels


def processor_samples(samples: Iterator[dict], processor: Any, labels: AnswerLabels):
    """webdataset samples -> what the processor makes of each alone, plus ``labels``; the
    per-token fields (``input_ids``, ``attention_mask``, ...) as 1-D tensors, the others
    (``pixel_values``, ``image_grid_thw``, ...) as the processor returns them."""
    for sample in samples:
        messages = json.loads(sample["json"])["messages"]
        text = processor.apply_chat_template(conversation(messages), tokenize=False)
        images = [open_image(sample[name]) for name in image_members(sample)]
        out = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        n = out["input_ids"].shape[1]
        fields = {k: v[0] if _per_token(v, n) else v for k, v in out.items()}
        fields["labels"] = torch.tensor(labels(fields["input_ids"].tolist()), dtype=torch.long)
        yield {"__key__": sample["__key__"], **fields}


def _per_token(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (1, length)


def pad_outputs(samples: list[dict], pad_token_id: int) -> dict:
    """A naive batch of processor outputs: per-token fields padded to the longest on the
    right (``input_ids`` with the pad token, ``labels`` with -100, the others with 0), the
    others concatenated (padded with zeros where their shapes differ past the first axis,
    as SmolVLM's images per sample do)."""
    longest = max(len(s["input_ids"]) for s in samples)
    names = [k for k in samples[0] if k != "__key__"]
    names += [k for s in samples[1:] for k in s if k != "__key__" and k not in names]
    batch: dict[str, Any] = {}
    for name in names:
        having = [s for s in samples if name in s]
        values = [s[name] for s in having]
        if len(having) == len(samples) and all(
            v.ndim == 1 and len(v) == len(s["input_ids"])
            for v, s in zip(values, having, strict=True)
        ):
            fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}.get(name, 0)
            out = torch.full((len(samples), longest), fill, dtype=values[0].dtype)
            for row, v in enumerate(values):
                out[row, : len(v)] = v
            batch[name] = out
        else:
            batch[name] = _concatenated(values)
    batch["sample_keys"] = [[s["__key__"]] for s in samples]
    return batch


def _concatenated(values: list[torch.Tensor]) -> torch.Tensor:
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].ndim)]
    if all(list(v.shape[1:]) == shape for v in values):
        return torch.cat(values)
    out = torch.zeros((sum(len(v) for v in values), *shape), dtype=values[0].dtype)
    at = 0
    for v in values:
        out[(slice(at, at + len(v)), *(slice(0, d) for d in v.shape[1:]))] = v
        at += len(v)
    return out


class _ProcessorStage:
    """webdataset stage: ``processor_samples`` (a class, so that it pickles into workers)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.labels = AnswerLabels(processor)

    def __call__(self, samples):
        return processor_samples(samples, self.processor, self.labels)


class _PadOutputs:
    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict]) -> dict:
        return pad_outputs(samples, self.pad_token_id)


def processor_pipeline(
    urls: list[str],
    processor: Any,
    max_length: int,
    batch_size: int,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
):
    """The naive way as a webdataset ``DataPipeline`` of padded batches."""
    tok = processor.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return webdataset_batches(
        urls,
        _ProcessorStage(processor),
        max_length,
        batch_size,
        _PadOutputs(0 if pad is None else pad),
        storage_options,
        layout,
    )


def _normalised(batch: dict) -> None:
    from ..families.inputs import model_inputs

    model_inputs(batch)


def run_processor_bench(
    source: str,
    processor: Any,
    *,
    max_length: int = 2048,
    batch_size: int = 8,
    workers: int = 2,
    limit: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
    model_inputs: bool = True,
    telemetry: Any = True,
) -> dict:
    """Throughput of the naive way (the processor per sample, padded batches) over one pass
    of ``source``, then of ``wdsvlm.Loader(processor=...)`` with ``wdsvlm.model_inputs`` on
    every batch (``model_inputs=False``: the batches alone, as on a GPU, where the
    normalisation is the device's), over one epoch, or each until ``limit`` samples;
    ``processor``: an object,
    a name or path, or ``"tiny:FAMILY"`` (see ``bench_processor``); ``telemetry``: the
    Loader's setting. Results as ``wdsvlm.bench.run_bench``'s."""
    from ..loader.loader import Loader

    processor = bench_processor(processor)

    def loader():
        return Loader(
            source,
            processor=processor,
            max_length=max_length,
            batch_size=batch_size,
            num_workers=workers,
            storage_options=storage_options,
            telemetry=telemetry,
        )

    ip = processor.image_processor
    return side_by_side(
        source,
        lambda urls, layout: processor_pipeline(
            urls, processor, max_length, batch_size, storage_options, layout
        ),
        loader,
        workers=workers,
        limit=limit,
        settings={
            "processor": type(processor).__name__,
            "image_processor": type(ip).__name__,
            "image_size": dict(ip.size) if getattr(ip, "size", None) else None,
            "max_length": max_length,
            "batch_size": batch_size,
            "model_inputs": model_inputs,
        },
        storage_options=storage_options,
        show_progress=show_progress,
        each=_normalised if model_inputs else None,
    )


def processor_bench_table(result: dict) -> str:
    """The result of ``run_processor_bench`` as a table."""
    settings = result["settings"]
    return bench_table(
        result,
        header=f"{settings['processor']} (image size {settings['image_size']}); naive: the "
        f"processor per sample, batches of {settings['batch_size']} padded to the longest, "
        f"float32 pixels; wdsvlm: batches [{settings['batch_size']}, "
        f"{settings['max_length']}] packed, uint8 pixels "
        + ("normalised by model_inputs" if settings["model_inputs"] else "(not normalised)"),
    )
