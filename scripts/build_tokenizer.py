"""Train the built-in byte-level BPE tokenizer on the reviews corpus and write it to the package.

Run once after changing the corpus: ``python scripts/build_tokenizer.py``. No network needed.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.builtin import EOS_TOKEN, PAD_TOKEN, TOKENIZER_FILE, reviews


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(reviews.corpus(), trainer=trainer)
    tokenizer.save(str(TOKENIZER_FILE))
    print(f"wrote {TOKENIZER_FILE} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
