#!/usr/bin/python3
"""Turns text into token files for a `tokens { ... }` job (nanoGPT's format).

Trains a SentencePiece BPE tokenizer (Debian's python3-sentencepiece; run this
with Debian's /usr/bin/python3) on the text, encodes it, and writes to --out:

  train.bin, val.bin   flat little-endian token ids (uint16 when the
                       vocabulary fits, else uint32)
  tokenizer.model      the SentencePiece model (tokenizer.vocab: its pieces)
  meta.json            vocabulary size, dtype, token counts, and the job
                       block that uses these files

Inputs are files or directories; a directory contributes every regular file
in it whose name has no extension (as `text { paths: ... }` does, which skips
fortune's .dat index files). Documents are split at lines holding only "%"
(fortune's separator) or at blank lines, and each ends with the end-of-text
id. The last --validation_fraction of the ids is held out as val.bin.

  /usr/bin/python3 deploy/tokenize.py --out data/fortunes /usr/share/games/fortunes
"""
import argparse
import array
import json
import os
import re
import sys
import tempfile
import time


def fail(message):
    print(f"tokenize: {message}", file=sys.stderr)
    sys.exit(2)


def text_files(paths):
    files = []
    for path in paths:
        if os.path.isdir(path):
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isfile(full) and "." not in name:
                    files.append(full)
        elif os.path.isfile(path):
            files.append(path)
        else:
            fail(f"{path}: no such file or directory")
    if not files:
        fail(f"no text files in {', '.join(paths)}")
    return files


def documents(files):
    docs = []
    for path in files:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        for doc in re.split(r"\n%\n|\n\s*\n", text):
            doc = doc.strip()
            if doc:
                docs.append(doc)
    return docs


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files or directories")
    parser.add_argument("--out", required=True, help="directory for the token files")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument("--validation_fraction", type=float, default=0.05,
                        help="tail of the ids held out as val.bin (default 0.05)")
    args = parser.parse_args()
    if not 64 <= args.vocab <= 1 << 20:
        fail(f"--vocab {args.vocab}: must be in [64, 2^20]")
    if not 0 < args.validation_fraction < 0.5:
        fail("--validation_fraction must be in (0, 0.5)")
    try:
        import sentencepiece as spm
    except ImportError:
        fail("needs sentencepiece: apt-get install python3-sentencepiece, and run this with "
             "/usr/bin/python3 (deploy/install-deps.sh installs it)")

    start = time.time()
    files = text_files(args.inputs)
    docs = documents(files)
    print(f"tokenize: {len(docs)} documents from {len(files)} files "
          f"({sum(len(d) for d in docs) / 1e6:.1f} M characters)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, "tokenizer")
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as corpus:
        for doc in docs:
            corpus.write(doc.replace("\n", " ") + "\n")
    try:
        print(f"tokenize: training a {args.vocab}-piece BPE tokenizer", flush=True)
        spm.SentencePieceTrainer.train(
            input=corpus.name, model_prefix=prefix, vocab_size=args.vocab, model_type="bpe",
            character_coverage=1.0, byte_fallback=True, num_threads=2,
            unk_id=0, bos_id=-1, eos_id=1, pad_id=-1, minloglevel=2)
    except RuntimeError as error:
        fail(f"sentencepiece could not train on this text: {error}")
    finally:
        os.unlink(corpus.name)
    processor = spm.SentencePieceProcessor(model_file=prefix + ".model")
    vocab = processor.get_piece_size()
    eos = processor.eos_id()
    typecode = "H" if vocab <= 1 << 16 else "I"
    ids = array.array(typecode)
    for i, doc in enumerate(docs):
        ids.extend(processor.encode(doc))
        ids.append(eos)
        if (i + 1) % 20000 == 0:
            print(f"tokenize: encoded {i + 1}/{len(docs)} documents", flush=True)
    if sys.byteorder != "little":
        ids.byteswap()
    held_out = int(len(ids) * args.validation_fraction)
    if held_out < 1:
        fail("too little text to hold any out")
    splits = {"train.bin": ids[:len(ids) - held_out], "val.bin": ids[len(ids) - held_out:]}
    for name, part in splits.items():
        with open(os.path.join(args.out, name), "wb") as f:
            part.tofile(f)
    dtype = "UINT16" if typecode == "H" else "UINT32"
    train = os.path.join(args.out, "train.bin")
    val = os.path.join(args.out, "val.bin")
    meta = {
        "vocab_size": vocab,
        "dtype": dtype,
        "eos_id": eos,
        "tokens_train": len(splits["train.bin"]),
        "tokens_validation": len(splits["val.bin"]),
        "tokenizer": "tokenizer.model",
        "job": f'tokens {{ train: "{train}" validation: "{val}" dtype: {dtype} }}',
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"tokenize: wrote {meta['tokens_train']} training and {meta['tokens_validation']} "
          f"held-out tokens ({dtype}, vocabulary {vocab}) to {args.out} in "
          f"{time.time() - start:.1f} s")
    print(f"tokenize: in the job: {meta['job']} and vocab: {vocab} in its model block")


if __name__ == "__main__":
    main()
