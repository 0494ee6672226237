"""``wdsvlm.hf.Trainer`` and ``with_loader(TrainerClass)``: a Hugging Face Trainer (or any
subclass, TRL's ``SFTTrainer`` among them) that trains on a ``wdsvlm.Loader``.

What changes against the stock Trainer, and why:

- data: each rank iterates its own Loader as it is (``feed.LoaderFeed``): the Loader already
  splits the data across ranks, so Accelerate does not re-shard it and no sampler or collator
  runs; ``len`` and ``set_epoch`` are the Loader's;
- loss: summed over the supervised tokens and divided by their count over every rank and every
  accumulated batch of the step (``num_items_in_batch``), for every model, also those that set
  ``accepts_loss_kwargs = False`` (Qwen2/2.5-VL), so it equals the mean over the step's tokens;
- evaluation: an ``eval_dataset`` that is a Loader made with ``evaluation=True`` is evaluated
  by ``evaluation.trainer_evaluate``: the loss over every supervised token of every rank, per
  source of a mixture, the training Loader untouched;
- logs: each training log (every ``logging_steps``) carries the Loader's figures since the
  previous one (``Loader.metrics()``, names under ``data/``), to every ``report_to``;
- checkpoints: every rank's Loader state is saved in each checkpoint folder and restored by
  ``train(resume_from_checkpoint=...)``; the Trainer then skips no batches (the Loader stands
  where the checkpoint left it) and the model's weights are read back under their current names.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import transformers
import transformers.trainer as trainer_module

from .. import compat
from ..errors import WdsvlmError
from ..loader.loader import Loader
from .checkpoint import load_loader_states, load_weights, save_loader_state
from .evaluation import trainer_evaluate
from .feed import LoaderFeed, positioned_skip

# transformers' private names used here (compat.TRAINER_METHODS among them), checked now: a
# version without them fails at import, not at the first checkpoint
compat.trainer_internals()

# the Trainer's public methods this integration overrides: checked once per class (the private
# ones by compat.trainer_methods)
HOOKS = ("get_train_dataloader", "compute_loss")


def supervised_token_loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
    """The cross-entropy of each next token whose label is not -100, summed and divided by
    ``num_items_in_batch`` (the step's supervised tokens on every rank), in float32."""
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise WdsvlmError(
            f"the model returned no logits ({type(outputs).__name__}): wdsvlm.hf computes the "
            "loss from them, over the supervised tokens of every rank"
        )
    labels = labels.to(logits.device)
    total = torch.nn.functional.cross_entropy(
        logits[..., :-1, :].flatten(0, -2).float(),
        labels[..., 1:].flatten(),
        ignore_index=-100,
        reduction="sum",
    )
    if num_items_in_batch is None:
        num_items_in_batch = (labels[..., 1:] != -100).sum()
    return total / torch.as_tensor(num_items_in_batch, device=total.device).clamp(min=1)


class LoaderTrainerMixin:
    """The behaviour ``with_loader`` adds to a Trainer class (see the module's docstring)."""

    def __init__(self, model: Any = None, args: Any = None, *positional: Any, **kwargs: Any):
        loader = kwargs.pop("loader", None)
        name = type(self).__name__
        if loader is None:
            raise TypeError(f"{name} needs loader=wdsvlm.Loader(...): it trains on its batches")
        if positional:
            raise TypeError(
                f"{name} takes model and args by position and everything else by keyword"
            )
        for key, why in (
            ("train_dataset", "the batches come from loader="),
            ("data_collator", "the Loader collates its packed batches itself"),
        ):
            if kwargs.get(key) is not None:
                raise TypeError(f"{name}: {key} cannot be passed with loader= ({why})")
        if kwargs.get("processing_class") is None and loader.settings.processor is not None:
            kwargs["processing_class"] = loader.settings.processor
        self.loader = loader
        self._feed: LoaderFeed | None = None
        super().__init__(model, args, train_dataset=stand_in(type(self), loader), **kwargs)
        check_settings(self)
        uses_trainer_loss = type(self).compute_loss is transformers.Trainer.compute_loss
        if self.compute_loss_func is None and uses_trainer_loss:
            # not the model's own loss: some models never see num_items_in_batch
            self.compute_loss_func = supervised_token_loss
        # num_items_in_batch is always given (below): the loss is normalised for accumulation
        self.loss_is_scaled_for_ga = True

    def get_train_dataloader(self) -> LoaderFeed:
        if self._feed is None:
            self._feed = LoaderFeed(self.loader, self.args.device, self.model)
        return self._feed

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """A training log (the one with ``loss``, every ``logging_steps``) gets the Loader's
        figures since the previous one (``Loader.metrics()``: names under ``data/``), so that
        ``report_to`` (TensorBoard, W&B ...) and the console get them with the loss; the
        evaluation's and the run's closing logs are left as they are."""
        if "loss" in logs:
            logs = {**logs, **self.loader.metrics(reset=True)}
        super().log(logs, *args, **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        """The supervised tokens (labels other than -100, after the shift) of the step's
        batches on every rank: what the loss is divided by."""
        if not batch_samples:
            return None
        count = sum((b["labels"][..., 1:] != -100).sum() for b in batch_samples).to(device)
        if self.args.world_size > 1:
            count = self.accelerator.gather(count.reshape(1)).sum()
        return count

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """For an evaluation ``wdsvlm.Loader`` (given here or as ``eval_dataset=``):
        ``{prefix}_loss`` over every supervised token of the pass on every rank, and per
        source of a mixture (``evaluation.trainer_evaluate``); else the Trainer's own."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset[dataset]  # one of several, by name (Trainer.evaluate)
        with self.loader._meter.work(loader=False):  # not the training steps' time
            if isinstance(dataset, Loader):
                return trainer_evaluate(self, dataset, metric_key_prefix)
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        check_ranks(self)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = trainer_module.get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint in the output folder {self.args.output_dir}")
        if resume_from_checkpoint:
            states = load_loader_states(resume_from_checkpoint)
            world = self.args.world_size
            if len(states) != world:
                raise WdsvlmError(
                    f"checkpoint {resume_from_checkpoint} was saved by {len(states)} ranks and "
                    f"this run has {world}: the Trainer counts its resumed epoch in steps of the "
                    "old length, so resume on the same number of ranks (Loader.load_state_dict "
                    "of all ranks' states resumes elsewhere in your own loop)"
                )
            self.loader.load_state_dict(states)
        elif (self.loader.epoch, self.loader.batches_done) != (0, 0):
            raise WdsvlmError(
                f"the Loader stands at batch {self.loader.batches_done} of epoch "
                f"{self.loader.epoch}, and train() without resume_from_checkpoint starts at step "
                "0 of epoch 0: give the Trainer a new Loader, or resume from a checkpoint"
            )
        self.loader.metrics(reset=True)  # the first log's figures: this run's steps only
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        epoch = compat.run_epoch_epoch(super()._run_epoch, args, kwargs)
        with positioned_skip(self.get_train_dataloader(), epoch):
            return super()._run_epoch(*args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = f"{trainer_module.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        checkpoint = os.path.join(compat.trainer_output_dir(self, trial), folder)
        # before the Trainer's files: its trainer_state.json, written last, marks a whole folder
        save_loader_state(
            checkpoint, self.loader.state_dict(), self.args.process_index, self.args.world_size
        )
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        target = self.model if model is None else model
        plain = isinstance(target, transformers.PreTrainedModel) and not hasattr(
            target, "peft_config"
        )
        if not (plain and load_weights(target, resume_from_checkpoint)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)


def check_ranks(trainer: Any) -> None:
    """The Loader splits the data for the rank and world size it was built for: they must be
    the Trainer's, or ranks would take each other's samples or leave some out."""
    config = trainer.loader.worker_config
    loader = (config.rank, config.world_size)
    args = (trainer.args.process_index, trainer.args.world_size)
    if loader != args:
        raise WdsvlmError(
            f"{type(trainer).__name__}: the Loader was built for rank {loader[0]} of world size "
            f"{loader[1]}, but this Trainer runs as rank {args[0]} of world size {args[1]}: "
            "build the Loader after torch.distributed.init_process_group (or under torchrun), "
            "or pass wdsvlm.Loader(rank=..., world_size=...) the Trainer's"
        )


def check_settings(trainer: Any) -> None:
    """Refuse the Trainer settings that cannot work with a Loader's packed batches, naming why."""
    args, name = trainer.args, type(trainer).__name__
    refused = {
        "dataloader_drop_last": (
            "the Loader's epochs are whole batches, the same number on every rank: there is no "
            "last short batch to drop"
        ),
        "group_by_length": (
            "the Loader packs samples into fixed-length rows: there are no lengths to group by"
        ),
    }
    for setting, why in refused.items():
        if getattr(args, setting, False):
            raise ValueError(f"{name}: {setting}=True cannot be used with loader= ({why})")
    loader_settings = {  # the DataLoader's settings: the Loader has its own
        "dataloader_num_workers": ("num_workers", 0),
        "dataloader_persistent_workers": ("persistent_workers", False),
        "dataloader_prefetch_factor": ("prefetch_factor", None),
    }
    for setting, (own, default) in loader_settings.items():
        value = getattr(args, setting, default)
        if value != default:
            raise ValueError(
                f"{name}: {setting}={value!r} would be ignored with loader= (the Trainer "
                f"builds no DataLoader): set wdsvlm.Loader({own}=...) instead"
            )
    if args.ignore_data_skip:
        raise ValueError(
            f"{name}: ignore_data_skip=True cannot be used with loader= (a resumed Loader "
            "stands where the checkpoint left it and skips nothing; the Trainer would count "
            "the resumed epoch from its start)"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        raise ValueError(
            f"{name}: train_sampling_strategy={strategy!r} cannot be used with loader= (the "
            "Loader orders and packs the samples itself; a sampler over lengths has nothing to "
            "sample)"
        )
    if not args.average_tokens_across_devices:
        raise ValueError(
            f"{name}: average_tokens_across_devices=False cannot be used with loader= (the loss "
            "is divided by the supervised tokens of every rank; per rank, packed rows weigh "
            "their tokens unequally)"
        )
    if args.label_smoothing_factor and trainer.compute_loss_func is None:
        raise ValueError(
            f"{name}: label_smoothing_factor cannot be used with loader= (its loss is divided by "
            "each rank's own tokens); pass a compute_loss_func that smooths the labels instead"
        )
    model = trainer.model
    config = getattr(model, "config", None)
    if config is not None and trainer.loader.family.name != "tiling":
        check_attention(config, name)
        check_video_timing(config, trainer.loader, name)


def check_video_timing(config: Any, loader: Any, name: str) -> None:
    """Qwen2.5-VL steps a video's temporal positions by its ``tokens_per_second`` per second;
    the Loader's positions use the published value, which the model must have where the
    Loader's data has videos."""
    from ..loader.build import has_videos

    family = loader.family
    if family.name != "qwen2_5_vl" or not has_videos(loader.plan):
        return
    vision = getattr(config, "vision_config", None)
    theirs = getattr(vision, "tokens_per_second", None)
    ours = getattr(family, "tokens_per_second", None)
    if theirs is not None and theirs != ours:
        raise ValueError(
            f"{name}: the model's vision_config.tokens_per_second is {theirs}, the Loader's "
            f"video positions step {ours} per second (Qwen2.5-VL as published): load the "
            f"model with vision_config.tokens_per_second={ours}"
        )


def check_attention(config: Any, name: str) -> None:
    """A packed row's samples are kept apart by their restarting position ids, with no 2-D
    attention mask: only the attention implementations that build their mask from position
    ids (or read them, as flash attention does) can do that."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = compat.attention_implementation(text)
    known = compat.mask_attention_implementations()
    if implementation is not None and implementation not in known:
        raise ValueError(
            f"{name}: attn_implementation={implementation!r} builds no attention mask from "
            "position ids, so the samples packed in one row would attend to each other; load "
            f"the model with one of {', '.join(sorted(known))}"
        )


def stand_in(cls: type, loader: Any) -> Any:
    """What the Trainer class gets as ``train_dataset``: it never reads it (the batches come
    from the Loader), but some classes check it at construction. TRL's trainers want a
    ``datasets.Dataset``, and a vision sample there keeps SFTTrainer from preparing it."""
    if any(c.__module__.startswith("trl.") for c in cls.__mro__):
        import datasets

        note = "the batches come from a wdsvlm.Loader"
        return datasets.Dataset.from_list(
            [{"messages": [{"role": "user", "content": note}], "images": []}]
        )
    return LoaderStandIn(loader)


class LoaderStandIn(torch.utils.data.Dataset):
    """The Trainer's ``train_dataset`` under ``loader=``: its length is a pass's samples."""

    def __init__(self, loader: Any):
        self.samples = loader.plan.num_samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> Any:
        raise TypeError("wdsvlm.hf: the Trainer's batches come from its loader=, not a dataset")


@functools.cache
def with_loader(trainer_class: type) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass, e.g. ``trl.SFTTrainer``)
    taking ``loader=wdsvlm.Loader(...)`` in place of ``train_dataset`` and ``data_collator``:
    ``with_loader(trl.SFTTrainer)(model=..., args=SFTConfig(...), loader=loader)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"with_loader takes a transformers.Trainer class, not {trainer_class!r}")
    missing = [h for h in HOOKS if not callable(getattr(trainer_class, h, None))]
    if missing:
        raise TypeError(
            f"{trainer_class.__name__} lacks the Trainer methods wdsvlm.hf hooks into "
            f"({', '.join(missing)}): transformers {transformers.__version__} is not supported"
        )
    compat.trainer_methods(trainer_class)
    return type(
        trainer_class.__name__,
        (LoaderTrainerMixin, trainer_class),
        {"__module__": __name__, "__qualname__": f"with_loader({trainer_class.__name__})"},
    )


Trainer = with_loader(transformers.Trainer)
Trainer.__doc__ = """A ``transformers.Trainer`` that trains on ``loader=wdsvlm.Loader(...)``:
``wdsvlm.hf.Trainer(model=model, args=TrainingArguments(...), loader=loader).train()``.
See ``wdsvlm.hf.trainer`` for what it changes, and the docs' Trainers page."""
