"""`harness data prepare|verify`: make a token-shard dataset, check one.

`prepare INPUT... --out URL --tokenizer SPEC` tokenizes text / JSON-lines inputs (`.gz`/`.zst`
too), parquet and arrow files and `save_to_disk` folders (the text in column --text-field), local
or any fsspec URL (`builtin:corpus` for the built-in corpus), into shards plus
`index.json` (harness/data/prepare.py); killed, it continues where it stopped when run again
with the same arguments. `verify URL` checks every shard's size, sha256 and end-of-document
count against the index.
Both take `-o KEY=VALUE` storage options (e.g. `-o endpoint_url=http://127.0.0.1:9000`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

from harness.cli.args import storage_option_parser, storage_options_of
from harness.data.integrity import shard_problem
from harness.data.prepare import PrepareSpec, prepare
from harness.data.shard_index import TOKENIZER_NAME, read_index
from harness.data.tokenizers_spec import EOD_TOKEN
from harness.errors import UserError
from harness.storage.location import output_folder


def cmd_prepare(args: argparse.Namespace) -> int:
    spec = PrepareSpec(inputs=tuple(args.inputs), tokenizer=args.tokenizer, field=args.field,
                       text_split=args.text_split, eod=args.eod, shard_tokens=args.shard_tokens)
    if args.workers < 0:
        raise UserError(f"--workers must be >= 0, got {args.workers}")
    # Here, not around prepare(): an OSError there may be an input's, not to be blamed on --out.
    output_folder(args.out, storage_options_of(args), "--out")
    index = prepare(spec, args.out, workers=args.workers, storage_options=storage_options_of(args))
    print(f"prepared {args.out}: {index.total_documents} documents, {index.total_tokens} tokens in "
          f"{len(index.shards)} shards ({index.dtype}), vocabulary {index.vocab_size}, index sha256 "
          f"{index.sha256[:16]}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every shard (size, hash, number of EOD ids) and the tokenizer match the index;
    else a UserError naming the first bad shard (and how many more there are)."""
    index, loc = read_index(args.url, storage_options_of(args))
    eod_id = int(index.tokenizer["eod_id"])
    problems = [p for entry in index.shards
                if (p := shard_problem(loc, entry, index.itemsize, check_hash=True, eod_id=eod_id))]
    tokenizer = loc.join(TOKENIZER_NAME)
    if loc.fs.exists(tokenizer):
        if hashlib.sha256(loc.fs.cat_file(tokenizer)).hexdigest() != index.tokenizer["sha256"]:
            problems.append(f"{loc.url_of(tokenizer)} does not match the index's tokenizer sha256")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(f"{problems[0]}{more}; prepare the dataset again or restore the file")
    print(f"ok: {args.url}: {len(index.shards)} shards, {index.total_tokens} tokens, {index.total_documents} "
          f"documents, sha256 and end-of-document counts verified",
          file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("data", help="prepare and verify token-shard datasets", description=__doc__)
    commands = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    storage = storage_option_parser()
    p = commands.add_parser("prepare", parents=[storage], help="tokenize inputs into shards + index.json")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text or JSON-lines files (.gz/.zst too), .parquet or .arrow files, folders saved by "
                        "datasets' save_to_disk; local or fsspec URLs; builtin:corpus")
    p.add_argument("--out", required=True, metavar="URL", help="the dataset folder (local path or fsspec URL)")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="a tokenizer.json path/URL, `bytes`, or `train-bpe:VOCAB` (trained on the inputs)")
    p.add_argument("--text-field", "--field", dest="field", default="text", metavar="NAME",
                   help="the field of JSON-lines inputs, the column of parquet/arrow ones, that holds each "
                        "document's text (default: text)")
    p.add_argument("--text-split", choices=["file", "line"], default="file",
                   help="text inputs: one document per file, or per non-empty line (default: file)")
    p.add_argument("--eod", default=EOD_TOKEN,
                   help=f"the token that ends each document (default {EOD_TOKEN}): a special token the tokenizer never "
                        f"gives for text (not its unknown-word token), since the index counts documents by it")
    p.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard (default 16777216)")
    p.add_argument("--workers", type=int, default=0,
                   help="tokenizer worker processes (default 0: in this process, where the tokenizer runs "
                        "its own threads; processes pay off on many cores with a slow tokenizer)")
    p.set_defaults(func=cmd_prepare)
    p = commands.add_parser("verify", parents=[storage],
                            help="check every shard's size, sha256 and end-of-document count against the index")
    p.add_argument("url", metavar="URL")
    p.set_defaults(func=cmd_verify)
