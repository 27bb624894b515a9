"""``train_mode: sft``: supervised fine-tuning on instruction records (full, or LoRA through the model).

The engine's loop as it is; the stage brings its data (conversations formatted with the chat template,
masked to the answers, packed: ``finetune/data.py``) and says that its rows train unequal numbers of
tokens, so each step's loss is the mean over the step's trained tokens on every layout.
"""

from __future__ import annotations

from canntrain_core.finetune.data import build_sft_data
from canntrain_core.train.trainer import Trainer


class SFTTrainer(Trainer):
    train_modes = ("sft",)
    formats_conversations = True
    token_weighted = True

    def build_data(self, config):
        r = self.recipe
        return build_sft_data(
            r.data,
            seed=r.experiment.seed,
            dp_rank=self.dp[0],
            dp_size=self.dp[1],
            model_type=config.model_type,
            **self.tokenizer_args(config),
        )
