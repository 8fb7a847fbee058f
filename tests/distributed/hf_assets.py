"""Local assets for the HF Trainer tests: generated text, a tokenizer trained on it, tiny model configs.

Nothing is downloaded: the text is generated from a seed, the byte-level BPE tokenizer is
trained on it with the ``tokenizers`` package, and the models are random from their configs.
"""
import os
import random

WORDS = {
    "det": ["the", "a", "every", "one", "that"],
    "noun": ["cat", "dog", "bird", "model", "stage", "rank", "token", "batch", "river", "tree"],
    "verb": ["sees", "sends", "holds", "finds", "trains", "passes", "likes", "counts"],
    "adj": ["red", "small", "quick", "quiet", "first", "last", "green", "tired"],
    "prep": ["near", "under", "after", "before", "beside"],
}


def sentence(rng: random.Random) -> str:
    """det adj? noun verb det noun (prep det noun)?: a grammar a tiny LM can learn a little of."""
    w = lambda kind: rng.choice(WORDS[kind])  # noqa: E731
    parts = [w("det")] + ([w("adj")] if rng.random() < 0.5 else []) + [w("noun"), w("verb"), w("det"), w("noun")]
    if rng.random() < 0.4:
        parts += [w("prep"), w("det"), w("noun")]
    return " ".join(parts) + "."


def write_text(path: str, lines: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(lines):
            fh.write(" ".join(sentence(rng) for _ in range(rng.randint(1, 3))) + "\n")
    return path


def write_tokenizer(folder: str, text_file: str, vocab_size: int = 320) -> str:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    with open(text_file) as fh:
        bpe.train_from_iterator(fh.read().splitlines(), vocab_size=vocab_size, min_frequency=2,
                                special_tokens=["<|endoftext|>", "<pad>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    return folder


def write_config(folder: str, kind: str, vocab: int, layers: int, tied: bool = True) -> str:
    from transformers import GPT2Config, LlamaConfig
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if kind == "gpt2":
        config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, tie_word_embeddings=tied, **common)
    else:
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, **common)
    config.save_pretrained(folder)
    return folder


MODELS = {"gpt2": ("gpt2", 4, True), "gpt2-5": ("gpt2", 5, True), "llama": ("llama", 2, False),
          "llama-tied": ("llama", 2, True)}


def make_assets(root: str) -> str:
    """Write everything under ``root`` (once); returns ``root``."""
    done = os.path.join(root, "DONE")
    if os.path.exists(done):
        return root
    os.makedirs(root, exist_ok=True)
    train = write_text(os.path.join(root, "train.txt"), 300, seed=1)
    write_text(os.path.join(root, "valid.txt"), 24, seed=2)
    tokenizer = write_tokenizer(os.path.join(root, "tokenizer"), train)
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    for name, (kind, layers, tied) in MODELS.items():
        write_config(os.path.join(root, name), kind, vocab, layers, tied)
    open(done, "w").close()
    return root
