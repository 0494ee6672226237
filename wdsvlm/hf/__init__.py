"""wdsvlm in the Hugging Face trainers: ``Trainer`` (a ``transformers.Trainer`` that trains on
``loader=wdsvlm.Loader(...)``) and ``with_loader(TrainerClass)``, the same for any Trainer
subclass, TRL's ``SFTTrainer`` among them. Importing it imports transformers and torch."""

from .evaluation import evaluation_loss
from .trainer import Trainer, supervised_token_loss, with_loader

__all__ = ["Trainer", "evaluation_loss", "supervised_token_loss", "with_loader"]
