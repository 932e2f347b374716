"""`hf-kvcodecs push-codebooks`: upload a saved codebook directory, with a card, to a Hub repo."""

from __future__ import annotations

from pathlib import Path

from ._common import add_command, add_push_arguments


def add_parser(commands) -> None:
    push = add_command(commands, "push-codebooks", "upload a codebook directory (and a card) to a Hub repo")
    push.add_argument("directory", type=Path, help="codebooks written by `hf-kvcodecs calibrate --out DIR`")
    push.add_argument("repo", help="Hub repo id (owner/name); created if missing")
    push.add_argument("--base-model", default=None, metavar="REPO",
                      help="Hub id of the model the codebooks were fitted for, linked from the card (default: none "
                           "linked)")
    add_push_arguments(push)
    push.set_defaults(func=command)


def command(args) -> int:
    from ..gsrq.hub import push_codebooks

    commit = push_codebooks(args.directory, args.repo, base_model=args.base_model, token=args.token, private=args.private)
    print(f"pushed {args.directory} to {args.repo}: {getattr(commit, 'commit_url', commit)}")
    return 0
