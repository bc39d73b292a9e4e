"""A Hugging Face ``transformers.Trainer`` script, run unchanged on Spark.

The Trainer reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``...) that spark_torch gives every rank, and trains with DDP. The model is a
tiny BERT built from a config, the data random token ids: nothing is downloaded::

    spark-torch run -n 2 examples/hf_trainer.py --max-steps 10
    spark-torch run --distributed --master spark://host:7077 -n 8 examples/hf_trainer.py
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=10)
    args = parser.parse_args()

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (256, 16), generator=generator)
    labels = (ids[:, 0] > 64).long()  # learnable: the first token decides
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.max_steps,
            per_device_train_batch_size=16,
            learning_rate=1e-3,
            use_cpu=not torch.cuda.is_available(),
            ddp_backend=None if torch.cuda.is_available() else "gloo",
            report_to=[],
            logging_steps=5,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data)
        result = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"trainer: world size {training.world_size}, steps {result.global_step}, loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
