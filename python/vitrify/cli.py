"""The ``vitrify`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger("vitrify.cli")


class CliError(Exception):
    """A command-line mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays behind ``--help``)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    if not os.path.exists(args.dir):
        raise CliError(f"--dir {args.dir}: no such directory")
    if not os.path.isdir(args.dir):
        raise CliError(f"--dir {args.dir}: not a directory")
    report = doctor.collect(args.dir)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(doctor.render(report))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    if args.keep is not None and not os.path.isdir(args.keep):
        raise CliError(f"--keep {args.keep}: not an existing directory")
    try:
        return demo.main(keep=args.keep)
    except demo.DemoFailure as e:  # --keep's own refusals (the parts report theirs inline)
        raise CliError(str(e)) from None


def _cmd_inspect(args: argparse.Namespace) -> int:
    from . import archive

    try:
        info = archive.inspect(args.archive)
        if args.relocations:
            from . import graph

            a = archive.open_archive(args.archive)
            audits = {r: graph.archive_relocation_audit(a, r) for r in a.ranks
                      if f"rank{r}/{graph.INDEX_FILE}" in a.files}
            if args.json:
                json.dump({str(k): v for k, v in audits.items()}, sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(graph.render_relocation_audit(audits) if audits
                      else f"{args.archive}: no graphs")
            return 0
    except (archive.ArchiveError, FileNotFoundError, ValueError) as e:
        print(f"vitrify inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(info, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(archive.render_inspect(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import archive

    problems = archive.verify(args.archive)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        return 1
    print(f"OK {args.archive}: every file present, sized and checksummed as the manifest says")
    return 0


def _cmd_tier_ls(args: argparse.Namespace) -> int:
    from . import tier

    slabs = tier.list_slabs(args.dir)
    where = args.dir or tier.default_dir()
    if args.json:
        print(json.dumps({"dir": where, "slabs": slabs}, indent=2))
        return 0
    if not slabs:
        print(f"no host slabs in {where}")
        return 0
    print(f"{'path':<48} {'MiB':>9} {'uid':>6} {'mode':>5} {'identity':<24} {'holder':<18} last use")
    for s in slabs:
        ident = f"{s['name']}/kind{s['kind']}" + ("" if s["identity_ok"] else " (foreign)")
        if s["holder"] is not None:
            holder = f"pid {s['holder']['pid']}"
        else:
            holder = "locked (unknown)" if s["locked"] else "-"
        print(f"{s['path']:<48} {s['bytes'] / 2**20:>9.1f} {s['uid']:>6} {s['mode']:>5} "
              f"{ident:<24} {holder:<18} {s['last_use']}")
    print(f"{len(slabs)} slab(s), {sum(s['bytes'] for s in slabs) / 2**20:.1f} MiB of memory")
    return 0


def _cmd_tier_clear(args: argparse.Namespace) -> int:
    from . import tier

    removed, kept = tier.remove_slabs(args.dir, name=args.name, force=args.force)
    if not removed and not kept:
        print(f"no host slabs to remove in {args.dir or tier.default_dir()}")
    for p in removed:
        print(f"removed {p}")
    for p in kept:
        print(f"kept {p}: an open store holds it (or another user owns it); --force removes it")
    return 1 if kept else 0


def _cmd_sglang(args: argparse.Namespace) -> int:
    from .integrations.sglang import launch

    try:
        return launch.run_command(args.sglang_command, args, args.sglang_args)
    except launch.LaunchError as e:
        print(f"vitrify sglang {args.sglang_command}: {e}", file=sys.stderr)
        return e.status


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vitrify", description=__import__("vitrify").__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"vitrify {__import__('vitrify').__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="report what this machine offers vitrify")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    d.add_argument("--dir", default=".", help="directory to probe for O_DIRECT (default: .)")
    d.set_defaults(func=_cmd_doctor)
    m = sub.add_parser("demo", help="run vitrify's main job here; says what was skipped and why")
    m.add_argument("--keep", metavar="DIR", default=None,
                   help="leave a copy of the demo's intact archive in DIR (DIR/demo.vitrify), to "
                        "try `vitrify inspect` and `vitrify verify` on")
    m.set_defaults(func=_cmd_demo)
    i = sub.add_parser("inspect", help="describe an archive: fingerprint, ranks, spans, graphs, sizes")
    i.add_argument("archive")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--relocations", action="store_true",
                   help="audit every graph's region-like words: relocated by kind, integers "
                        "kept, unclassified (non-relocatable)")
    i.set_defaults(func=_cmd_inspect)
    v = sub.add_parser("verify", help="check every file of an archive (exit 0 intact, 1 damaged)")
    v.add_argument("archive")
    v.set_defaults(func=_cmd_verify)
    t = sub.add_parser("tier", help="the host tier's slabs in shared memory: list, remove")
    tsub = t.add_subparsers(dest="tier_command", required=True)
    tl = tsub.add_parser("ls", help="list host slabs: path, memory, owner, identity, holder, "
                                    "last use")
    tl.add_argument("--dir", default=None,
                    help="host-tier directory (default: $VITRIFY_HOST_DIR/vitrify-<uid>)")
    tl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tl.set_defaults(func=_cmd_tier_ls)
    tc = tsub.add_parser("clear", help="remove host slabs (not those an open store holds, "
                                       "unless --force); exit 1 when some were kept")
    tc.add_argument("--dir", default=None,
                    help="host-tier directory (default: $VITRIFY_HOST_DIR/vitrify-<uid>)")
    tc.add_argument("--name", default=None, help="only the slabs of this store name")
    tc.add_argument("--force", action="store_true",
                    help="also remove slabs an open store holds (it keeps its mapping until it "
                         "closes; a restart finds nothing)")
    tc.set_defaults(func=_cmd_tier_clear)
    # vitrify sglang save/load/serve/check ... -- SGLANG_ARGS (integrations/sglang/launch.py)
    from .integrations.sglang import launch

    launch.add_parser(sub)
    sub.choices["sglang"].set_defaults(func=_cmd_sglang)
    # vitrify bench NAME: the benchmarks (vitrify/bench/), one subcommand each with its options
    from .bench import cli as bench_cli

    bench_cli.add_parser(sub)
    return p


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    first = text.splitlines()[0]
    return first + (" ..." if first != text else "")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every error is one line on stderr and a non-zero exit status (2: a
    command-line or settings mistake, 1: the command failed, 130: interrupted); the traceback
    goes to the ``vitrify.cli`` logger at DEBUG (``VITRIFY_LOG_LEVEL=DEBUG`` shows it)."""
    from . import config
    from .integrations.sglang import launch

    # vitrify sglang ...: what follows the first "--" is SGLang's, untouched by this parser
    ours, sglang_args = launch.split_argv(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(ours)
    args.sglang_args = sglang_args
    prog = f"vitrify {args.command}"
    try:
        config.settings()  # a bad VITRIFY_* value stops here, named, before any work
    except ValueError as e:
        if str(e) != config.reported_at_import():  # the import already printed that line
            print(f"vitrify: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as e:  # one line for the user, the traceback for whoever asks for it
        log.debug("%s failed", prog, exc_info=True)
        print(f"{prog}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
