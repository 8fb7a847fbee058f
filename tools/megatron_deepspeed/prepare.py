"""Prepare an offline scratch workspace for running Megatron-DeepSpeed's unchanged ``pretrain_gpt.py``.

Why: the script needs its repository (not vendored into ds_chimera), a GPT-2 style tokenizer (the hub is not
reachable), an indexed dataset (.bin/.idx) built by the repo's own ``tools/preprocess_data.py``, and the
repo's C++ data helpers (``megatron/data/helpers.cpp``, built with pybind11). This script makes all of them
under one scratch directory (default /tmp/mds) and is idempotent: steps whose outputs exist are skipped.

    python3 tools/megatron_deepspeed/prepare.py [--workdir /tmp/mds] [--force]

Layout made:
    WORKDIR/Megatron-DeepSpeed/     the repo's HEAD, exported from the bare mirror (git archive)
    WORKDIR/site/                   pybind11 + nltk (pip install --no-deps --target; not system-wide)
    WORKDIR/tokenizer/vocab.json, merges.txt   byte-level BPE trained on the generated corpus
    WORKDIR/data/corpus.jsonl       generated text (seeded, so identical on every run of this script)
    WORKDIR/data/corpus_text_document.bin/.idx  the indexed dataset
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig

MIRROR = "/work/.mirror/deepspeedai+Megatron-DeepSpeed/repo"
VOCAB_SIZE = 500          # padded by Megatron to 512 (--make-vocab-size-divisible-by 128)
N_DOCS = 3000


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def export_repo(workdir, force):
    repo = os.path.join(workdir, "Megatron-DeepSpeed")
    if os.path.exists(os.path.join(repo, "pretrain_gpt.py")) and not force:
        return repo
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    archive = subprocess.run(["git", "--git-dir", MIRROR, "archive", "HEAD"], check=True, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", repo], input=archive.stdout, check=True)
    head = subprocess.run(["git", "--git-dir", MIRROR, "rev-parse", "HEAD"], check=True, stdout=subprocess.PIPE,
                          text=True).stdout.strip()
    with open(os.path.join(repo, "MIRROR_HEAD"), "w") as fh:
        fh.write(head + "\n")
    print(f"exported Megatron-DeepSpeed {head} to {repo}")
    return repo


def ensure_build_deps(workdir):
    """pybind11 (helpers.cpp) and nltk (preprocess_data.py uses nltk.tokenize at import time, even without
    --split-sentences) into WORKDIR/site with --no-deps, so nothing else there shadows installed packages.
    Only prepare.py puts WORKDIR/site on PYTHONPATH; training does not need it."""
    site = os.path.join(workdir, "site")
    missing = []
    for mod in ("pybind11", "nltk"):
        try:
            __import__(mod)
        except ImportError:
            if not os.path.isdir(os.path.join(site, mod)):
                missing.append(mod)
    if missing:
        run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site] + missing)
    return site


def build_helpers(repo, site):
    data = os.path.join(repo, "megatron", "data")
    lib = os.path.join(data, "helpers" + sysconfig.get_config_var("EXT_SUFFIX"))
    if os.path.exists(lib):
        return
    env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run(["make", "-C", data], env=env)        # the repo's own Makefile (what compile_helper() runs)
    assert os.path.exists(lib), lib


WORDS = ("the a one every some no cat dog bird fish tree river stone cloud king queen child robot "
         "runs sees eats finds likes builds carries paints follows hides under over near behind with "
         "red blue green small big old new quiet loud fast slow and but then so because").split()


def make_corpus(path):
    """Seeded pseudo-English: short sentences over a small grammar, so a tiny model's loss falls."""
    if os.path.exists(path):
        return
    rng = random.Random(1234)
    det, noun = WORDS[:6], WORDS[6:18]
    verb, prep = WORDS[18:26], WORDS[26:31]
    adj, conj = WORDS[31:39], WORDS[39:]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for _ in range(N_DOCS):
            sents = []
            for _ in range(rng.randint(3, 8)):
                s = f"{rng.choice(det)} {rng.choice(adj)} {rng.choice(noun)} {rng.choice(verb)} " \
                    f"{rng.choice(det)} {rng.choice(noun)}"
                if rng.random() < 0.5:
                    s += f" {rng.choice(prep)} {rng.choice(det)} {rng.choice(noun)}"
                if rng.random() < 0.3:
                    s += f" {rng.choice(conj)} {rng.choice(noun)} {rng.choice(verb)}"
                sents.append(s.capitalize() + ".")
            fh.write(json.dumps({"text": " ".join(sents)}) + "\n")


def make_tokenizer(corpus, outdir):
    """Byte-level BPE (the GPT-2 byte<->unicode map) saved as GPT-2 vocab.json + merges.txt."""
    vocab, merges = os.path.join(outdir, "vocab.json"), os.path.join(outdir, "merges.txt")
    if os.path.exists(vocab) and os.path.exists(merges):
        return vocab, merges
    from tokenizers import ByteLevelBPETokenizer
    texts = [json.loads(line)["text"] for line in open(corpus)]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=VOCAB_SIZE, min_frequency=2,
                            special_tokens=["<|endoftext|>"])          # Megatron's GPT2 eod token
    os.makedirs(outdir, exist_ok=True)
    tok.save_model(outdir)      # merges.txt starts with '#version', which Megatron's reader skips
    return vocab, merges


def build_dataset(repo, site, corpus, vocab, merges, prefix):
    if os.path.exists(prefix + "_text_document.idx"):
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, site, os.environ.get("PYTHONPATH", "")]),
               DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    run([sys.executable, os.path.join(repo, "tools", "preprocess_data.py"),
         "--input", corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "1",
         "--dataset-impl", "mmap"], env=env, cwd=repo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.environ.get("MDS_WORKDIR", "/tmp/mds"))
    ap.add_argument("--force", action="store_true", help="re-export the repo (data and tokenizer are kept)")
    args = ap.parse_args()
    workdir = os.path.abspath(args.workdir)
    repo = export_repo(workdir, args.force)
    site = ensure_build_deps(workdir)
    build_helpers(repo, site)
    corpus = os.path.join(workdir, "data", "corpus.jsonl")
    make_corpus(corpus)
    vocab, merges = make_tokenizer(corpus, os.path.join(workdir, "tokenizer"))
    build_dataset(repo, site, corpus, vocab, merges, os.path.join(workdir, "data", "corpus"))
    print(f"ready: {workdir}")


if __name__ == "__main__":
    main()
