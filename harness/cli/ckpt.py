"""`harness ckpt ls|verify|show|diff|consolidate|export|gc`: look at, check, export and prune checkpoints
from the shell.

Every command takes local paths or fsspec URLs, and `-o KEY=VALUE` (repeatable) for the
storage options a run's `checkpoint.storage_options` holds, e.g. `-o endpoint_url=http://minio:9000`
or `-o retry.deadline_s=30`. A checkpoint is named by its folder
(`RUN_DIR/checkpoints/step-00001200`); `verify` also takes a run dir and checks every
checkpoint in it. `consolidate` writes a checkpoint's model, whole, as `DIR/model.safetensors`
(checkpoint/consolidate.py; sharded or not); `export --format hf` writes a transformers model's
checkpoint as a Hugging Face model folder (config, weights, generation config, tokenizer;
export/hf_folder.py). `gc` applies the run's own retention policy (`checkpoint.keep_last` /
`keep_every` from its run.json; `--keep-last` / `--keep-every` override), never removes the
newest checkpoint that verifies, removes no committed checkpoint while none verifies, and with
`--dry-run` only lists what it would remove. Exit codes: 0 good/equal, 1 a verification failure
or a difference, 2 a user error (missing run dir, unknown protocol, not a checkpoint, a run dir
gc cannot write to).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from harness.checkpoint.consolidate import consolidate
from harness.checkpoint.diff import diff_checkpoints
from harness.checkpoint.discovery import CHECKPOINTS_DIR, CheckpointRef
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.format import tensor_refs
from harness.checkpoint.integrity import verify_target
from harness.checkpoint.store import CheckpointStore
from harness.checkpoint.target import open_target
from harness.cli.args import storage_option_parser, storage_options_of
from harness.errors import StorageError
from harness.records.run_id import RUN_JSON
from harness.storage.location import read_bytes


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _checkpoint(url: str, options: dict[str, Any] | None) -> tuple[CheckpointStore, CheckpointRef]:
    store, ref = open_target(url, options)
    if ref is None:
        raise CheckpointError(f"{url} is a run dir, not a checkpoint; name one folder, "
                              f"e.g. {url.rstrip('/')}/{CHECKPOINTS_DIR}/step-00000100")
    return store, ref


def cmd_ls(args: argparse.Namespace) -> int:
    store, ref = open_target(args.run_dir, storage_options_of(args))
    if ref is not None:
        raise CheckpointError(f"{args.run_dir} is a checkpoint; `harness ckpt ls` takes its run dir")
    refs, incomplete = store.scan()
    if not refs and not incomplete:
        print(f"no checkpoints in {store.url}")
        return 0
    print(f"{'step':>10}  {'size':>10}  {'created':20}  status")
    for r in refs:
        problems = store.verify(r)
        try:
            m = store.manifest(r)
            size, created = _size(m.nbytes), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created))
        except StorageError:
            size, created = "?", "?"
        status = "verified" if not problems else f"BAD ({len(problems)} problem(s)): {problems[0]}"
        print(f"{r.step:>10}  {size:>10}  {created:20}  {status}")
    for path in incomplete:
        print(f"{'-':>10}  {'-':>10}  {'-':20}  incomplete, not a checkpoint: {store.loc.url_of(path)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    return verify_target(args.target, storage_options_of(args))


def cmd_show(args: argparse.Namespace) -> int:
    store, ref = _checkpoint(args.checkpoint, storage_options_of(args))
    manifest, state = store.manifest(ref), store.read_state(ref)
    headers = store.tensor_headers(ref)
    print(f"checkpoint {ref.url}")
    print(f"  step {manifest.step}, written by {manifest.writer} at "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(manifest.created))}, {_size(manifest.nbytes)}")
    print("files:")
    for f in manifest.files:
        print(f"  {f.name:28} {_size(f.size):>10}  {f.algorithm} {f.digest[:16]}")
    print("parts:")
    for part, tree in state["parts"].items():
        refs = tensor_refs(tree)
        print(f"  {part}: {len(refs)} tensor(s)" + (f" in {sorted({f for f, _ in refs.values()})}" if refs else ""))
    for file, entries in headers.items():
        print(f"tensors in {file}:")
        for e in sorted(entries.values(), key=lambda e: e.start):
            print(f"  {e.name:48} {e.describe():24} {_size(e.end - e.start):>10}")
    print("meta:")
    print("  " + json.dumps(state.get("meta", {}), indent=1).replace("\n", "\n  "))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    lines, equal = diff_checkpoints(_checkpoint(args.a, storage_options_of(args)),
                                    _checkpoint(args.b, storage_options_of(args)))
    for line in lines:
        print(line)
    print("bitwise equal" if equal else "checkpoints differ")
    return 0 if equal else 1


def cmd_consolidate(args: argparse.Namespace) -> int:
    store, ref = _checkpoint(args.checkpoint, storage_options_of(args))
    url, size = consolidate(store, ref, args.out, storage_options_of(args))
    print(f"wrote {url} ({_size(size)}): the model of step {ref.step}, whole")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from harness.export.hf_folder import export_hf  # transformers, for this command only

    store, ref = _checkpoint(args.checkpoint, storage_options_of(args))
    done = export_hf(store, ref, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                     storage_options=storage_options_of(args))
    for note in done.notes:
        print(note)
    print(f"wrote {done.url} ({_size(done.nbytes)}: {', '.join(done.files)}): the model of step {ref.step}, "
          "a Hugging Face model folder")
    return 0


def _shard_size(text: str) -> int:
    from harness.export.hf_folder import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_gc(args: argparse.Namespace) -> int:
    """Retention by the run's own policy (run.json), never removing the newest good checkpoint,
    nor any committed one while none verifies (they are the evidence of what went wrong)."""
    options = storage_options_of(args)
    store, ref = open_target(args.run_dir, options)
    if ref is not None:
        raise CheckpointError(f"{args.run_dir} is a checkpoint; `harness ckpt gc` takes its run dir")
    keep_last, keep_every = retention_policy(store, args.keep_last, args.keep_every)
    store = CheckpointStore(store.url, keep_last=keep_last, keep_every=keep_every, storage_options=options)
    committed = store.list()
    good = store.latest_good()
    newest_good = None if good is None else good.step
    if good is None and committed:
        print(f"no checkpoint in {store.url} verifies: keeping all {len(committed)} (see `harness ckpt verify`)")
    verb = "would remove" if args.dry_run else "removed"
    try:
        if args.dry_run:
            removed = store.gc(newest_good, dry_run=True)
        else:
            with store.lease(takeover=args.takeover):
                removed = store.gc(newest_good)
    except OSError as e:
        raise CheckpointError(f"cannot remove checkpoints in {store.url}: {e}; gc needs a writable run dir "
                              "(--dry-run lists what it would remove without writing)") from None
    for url in removed:
        print(f"{verb} {url}")
    policy = f"keep_last={keep_last}, keep_every={keep_every}" + (f", newest good step {good.step}" if good else "")
    kept = len({r.url for r in committed} - set(removed))
    print(f"{len(removed)} {verb}, {kept} checkpoint(s) kept ({policy})")
    return 0


def retention_policy(store: CheckpointStore, keep_last: int | None, keep_every: int | None) -> tuple[int, int]:
    """(keep_last, keep_every): the flags where given, else the run's own `checkpoint` settings
    from its run.json; a run dir without run.json needs --keep-last (--keep-every is then 0
    unless given)."""
    if keep_last is not None and keep_every is not None:
        return keep_last, keep_every
    run_json = f"{store.loc.root}/{RUN_JSON}"
    if not store.loc.fs.exists(run_json):
        if keep_last is not None:
            return keep_last, 0
        raise CheckpointError(f"no {RUN_JSON} in {store.url} to read the run's retention policy from: "
                              "give it, e.g. `harness ckpt gc RUN_DIR --keep-last 3 --keep-every 0`")
    try:
        policy = json.loads(read_bytes(store.loc, run_json, 1 << 24))["config"]["checkpoint"]
        saved_last, saved_every = int(policy["keep_last"]), int(policy["keep_every"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{store.loc.url_of(run_json)} has no readable checkpoint.keep_last/keep_every "
                              f"({type(e).__name__}: {e}); give --keep-last and --keep-every") from None
    return (saved_last if keep_last is None else keep_last), (saved_every if keep_every is None else keep_every)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("ckpt", help="inspect, verify and prune checkpoints", description=__doc__)
    commands = parser.add_subparsers(dest="ckpt_command", required=True, metavar="SUBCOMMAND")
    storage = storage_option_parser()
    p = commands.add_parser("ls", parents=[storage], help="list checkpoints with sizes and whether they verify")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (path or URL) given to `harness train`")
    p.set_defaults(func=cmd_ls)
    p = commands.add_parser("verify", parents=[storage],
                            help="check sizes and digests of a checkpoint or of every one in a run dir")
    p.add_argument("target", metavar="RUN_DIR|CKPT", help="a run dir (every checkpoint in it) or one checkpoint folder "
                   "RUN_DIR/checkpoints/step-NNNNNNNN")
    p.set_defaults(func=cmd_verify)
    p = commands.add_parser("show", parents=[storage], help="parts, tensors and metadata of one checkpoint")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, RUN_DIR/checkpoints/step-NNNNNNNN")
    p.set_defaults(func=cmd_show)
    p = commands.add_parser("diff", parents=[storage], help="compare two checkpoints; exit 0 only when bitwise equal")
    p.add_argument("a", metavar="CKPT_A", help="a checkpoint folder, RUN_DIR/checkpoints/step-NNNNNNNN")
    p.add_argument("b", metavar="CKPT_B", help="the checkpoint folder to compare it with")
    p.set_defaults(func=cmd_diff)
    p = commands.add_parser("consolidate", parents=[storage], help="write a checkpoint's model, whole, as one plain "
                            "safetensors file (any world size or sharding; streamed one tensor at a time)")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, RUN_DIR/checkpoints/step-NNNNNNNN")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder (path or URL) model.safetensors goes into")
    p.set_defaults(func=cmd_consolidate)
    p = commands.add_parser("export", parents=[storage], help="write a checkpoint of a transformers model as a "
                            "Hugging Face model folder that from_pretrained, vLLM and llama.cpp's converters open")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, RUN_DIR/checkpoints/step-NNNNNNNN (any "
                   "world size or sharding)")
    p.add_argument("--format", required=True, choices=["hf"], help="hf: config.json, model.safetensors (sharded "
                   "past --max-shard-size), generation_config.json and the run's tokenizer files")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder (path or URL)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="convert the floating tensors "
                   "(default: as trained)")
    p.add_argument("--max-shard-size", type=_shard_size, default="5GB", metavar="SIZE", help="split the weights "
                   "into files of at most SIZE (5GB, 500MB, 2GiB; default 5GB) with model.safetensors.index.json")
    p.set_defaults(func=cmd_export)
    p = commands.add_parser("gc", parents=[storage], help="apply the run's retention policy and remove leftovers of "
                            "dead writers; never removes the newest good checkpoint")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (path or URL) given to `harness train`")
    p.add_argument("--keep-last", type=int, help="keep the newest K checkpoints (K >= 2; default: the run's "
                   "checkpoint.keep_last from its run.json)")
    p.add_argument("--keep-every", type=int, help="also keep steps divisible by M (0: off; default: the run's "
                   "checkpoint.keep_every from its run.json)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--takeover", action="store_true", help="take the run dir lease even if a writer holds it")
    p.set_defaults(func=cmd_gc)
