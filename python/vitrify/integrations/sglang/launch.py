"""``vitrify sglang save|load|serve|check``: an SGLang server under vitrify in one command.

::

    vitrify sglang save  ARCHIVE [options] -- <SGLang server arguments>
    vitrify sglang load  ARCHIVE [options] -- <SGLang server arguments>
    vitrify sglang serve ARCHIVE [options] -- <SGLang server arguments>
    vitrify sglang check [--archive ARCHIVE] -- <SGLang server arguments>

``save``, ``load`` and ``serve`` check what can be checked before SGLang starts, write the
plugin's TOML (``config.py``), set ``VITRIFY_SGLANG_CONFIG`` to it and replace this process with
SGLang's own launcher, ``<this python> -m sglang.launch_server <the arguments after -->``, the
arguments unchanged (``os.execvpe``). ``serve`` LOADs when ARCHIVE exists and matches, and
otherwise starts SGLang as usual and SAVEs there. ``check`` says what vitrify would refuse or
change, without a GPU and without starting anything.

Before SGLang starts, each refusal is one line and exit status 2 (nothing started):

- SGLang not installed, or not a version the plugin supports (``versions.SUPPORTED``);
  vitrify's entry point not installed; ``SGLANG_PLUGINS`` set without ``vitrify``;
- an argument SGLang's own parser refuses (the arguments are parsed with
  ``ServerArgs.add_cli_args``, the parser ``sglang.launch_server`` builds; nothing is resolved:
  that needs the GPU and may read the model's files);
- an argument the plugin refuses (``server_args.refusals``, with the release's refused
  environment switches, and ``server_args.unsupported``: the same functions the plugin calls
  while the server starts), and ``--random-seed`` unset (SGLang then
  draws one per start; it is part of what LOAD compares, so no archive would ever match);
- ``save``: ARCHIVE exists (a new archive is written; remove the old one yourself: nothing is
  overwritten), or its parent is not a writable directory;
- ``load``: ARCHIVE missing; ``load``/``serve``: ARCHIVE damaged, or not matching what can be
  compared here: engine and versions (SGLang, vitrify), the GPU, driver, CUDA and torch (where
  a GPU is visible), the model path. The plugin compares every engine-shaping argument when the
  scheduler opens the archive, and decides then (``--on-mismatch``);
- an option out of range (the plugin's own validation, ``config.from_mapping``).

The TOML is written to ``<tempdir>/vitrify-<uid>/sglang/<archive name>.<mode>.<hash>.toml``
(a directory of this user, 0700; the file 0600, replaced atomically, one per archive and mode):
every process of the server reads it when it starts, and nothing removes it after the exec.
``--dry-run`` prints it and the exact command line instead, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shlex
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from . import config as _config
from . import server_args as rules
from . import state, versions

log = logging.getLogger("vitrify.sglang")

LAUNCHER = ("-m", "sglang.launch_server")  # SGLang's own launcher, run by this Python
ENTRY_POINT_GROUP = "sglang.srt.plugins"
COMMANDS = ("save", "load", "serve", "check")


class LaunchError(Exception):
    """Refused before SGLang starts: a one-line message; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(" ".join(str(message).split()))
        self.status = status


# ---------------------------------------------------------------------------------------------
# SGLang: the installed version, its own argument parser
# ---------------------------------------------------------------------------------------------


def _supported() -> str:
    return versions.supported_text()


def sglang_version() -> str:
    """The installed SGLang's version (from its package metadata: importing SGLang takes
    seconds), refused unless the plugin supports it."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise LaunchError(f"SGLang is not installed in this Python ({sys.executable}); "
                          f"vitrify's SGLang plugin runs SGLang {_supported()}") from None
    if version not in versions.SUPPORTED:
        raise LaunchError(f"SGLang {version} is installed; this vitrify supports SGLang "
                          f"{_supported()} (the plugin would stop the server)")
    return version


class _SGLangParser(argparse.ArgumentParser):
    """SGLang's parser with its usage errors as one line (argparse prints the whole usage,
    hundreds of lines, and exits)."""

    def error(self, message: str):  # type: ignore[override]
        raise LaunchError(f"SGLang's argument parser: {message} (python -m sglang.launch_server "
                          f"--help lists its arguments)")


def release(version: str | None = None) -> Any:
    """The plugin's module for SGLang ``version`` (default: the installed one, from its
    metadata: :func:`sglang_version`)."""
    return versions.for_version(sglang_version() if version is None else version)


def parse_server_args(argv: list[str], ver: Any = None) -> argparse.Namespace:
    """``argv`` parsed by SGLang's own parser, as ``sglang.launch_server`` parses it
    (``prepare_server_args``: ``ServerArgs.add_cli_args``, a ``--config`` YAML merged through
    the release's ``ConfigArgumentMerger``), without building ``ServerArgs`` (its resolution
    needs the GPU and may read the model's files). The Namespace has one attribute per server
    argument. ``--help`` prints SGLang's help and exits."""
    import pkgutil

    ver = release() if ver is None else ver
    try:
        with warnings.catch_warnings():  # SGLang's imports warn about the missing GPU, etc.
            warnings.simplefilter("ignore")
            from sglang.srt.server_args import ServerArgs
    except Exception as e:  # ImportError, or whatever SGLang's imports raise here
        raise LaunchError(f"cannot import SGLang's server arguments (sglang.srt.server_args): "
                          f"{type(e).__name__}: {e}") from None
    parser = _SGLangParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    argv = list(argv)
    if "--config" in argv:
        try:
            merger = pkgutil.resolve_name(ver.CONFIG_MERGER)
            argv = merger(parser).merge_config_with_args(argv)
        except LaunchError:
            raise
        except Exception as e:
            raise LaunchError(f"SGLang's --config: {type(e).__name__}: {e}") from None
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# what vitrify refuses, what it changes
# ---------------------------------------------------------------------------------------------


def environment_problems(env: Mapping[str, str]) -> list[str]:
    """Why SGLang would start without the plugin here: its entry point not installed, or
    ``SGLANG_PLUGINS`` (SGLang's allow-list) without ``vitrify``."""
    problems = []
    if not any(ep.name == "vitrify" for ep in importlib.metadata.entry_points(
            group=ENTRY_POINT_GROUP)):
        problems.append(f"vitrify's SGLang entry point ({ENTRY_POINT_GROUP}) is not installed "
                        f"in this Python: reinstall vitrify here")
    allowed = env.get("SGLANG_PLUGINS", "")
    if allowed.strip() and "vitrify" not in {x.strip() for x in allowed.split(",")}:
        problems.append(f"SGLANG_PLUGINS={allowed!r} does not list vitrify: SGLang would not "
                        f"load the plugin")
    return problems


def server_problems(ns: argparse.Namespace, env: Mapping[str, str] | None = None,
                    ver: Any = None) -> list[str]:
    """What vitrify refuses in the parsed arguments (and, with ``env``, the release's refused
    environment switches): the plugin's refusals while SGLang resolves the arguments and at the
    scheduler's start (the same functions), and an unset ``--random-seed``."""
    ver = release() if ver is None else ver
    problems = rules.refusals(ns, ver, env) + rules.unsupported(ns, ver)
    if getattr(ns, "random_seed", None) is None:
        problems.append("random_seed unset (--random-seed): SGLang draws one at every start and "
                        "LOAD compares it, so no archive would ever match; pass --random-seed N")
    return problems


@contextlib.contextmanager
def _plugin_scratch() -> Iterator[list[str]]:
    """``server_args.apply_server_args`` on a scratch plugin state (it records the first prefill
    setting it saw), its log lines (the reasons for each change, in the plugin's words)
    collected instead of printed."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.INFO)
    saved = state.STATE, log.level, log.propagate
    state.STATE = state.PluginState()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield said
    finally:
        log.removeHandler(handler)
        state.STATE, level, log.propagate = saved
        log.setLevel(level)


def changes(ns: argparse.Namespace, mode: str, ver: Any = None) -> tuple[list[str], list[str]]:
    """What the plugin's argument rules (``server_args.apply_server_args``, the same on every
    release) change in these arguments in ``mode``: ``field before -> after`` each, and the
    plugin's reasons."""
    ver = release() if ver is None else ver
    after = copy.deepcopy(ns)
    with _plugin_scratch() as said:
        try:
            rules.apply_server_args(after, mode, ver)
        except state.PluginFatal as e:  # refused: server_problems names it first
            raise LaunchError(str(e)) from None
    diffs = [f"{name} {value!r} -> {getattr(after, name)!r}" for name, value in vars(ns).items()
             if getattr(after, name, value) != value]
    return diffs, said


# ---------------------------------------------------------------------------------------------
# the archive
# ---------------------------------------------------------------------------------------------


def open_matching(path: str, ns: argparse.Namespace | None, version: str, device: int) -> Any:
    """Open the archive at ``path`` and compare what can be compared before SGLang starts: the
    engine and its versions (``freeze.Engine``'s fingerprint: an archive of another SGLang
    release is refused naming both), this machine's GPU, driver,
    CUDA and torch where a GPU is visible (``archive.Fingerprint.current``) and, with parsed
    arguments, the model path. Returns the opened archive; a mismatch is an
    ``archive.ArchiveMismatch`` (the plugin's own comparison at LOAD covers every
    engine-shaping argument), damage an ``archive.ArchiveError``."""
    from ... import archive as _archive
    from . import freeze

    engine = freeze.Engine({}, version).fingerprint()
    try:
        here = _archive.Fingerprint.current(engine=engine["engine"],
                                            engine_version=engine["engine_version"],
                                            device=device)
    except (RuntimeError, ValueError) as e:
        raise LaunchError(f"GPU {device} (--base-gpu-id): {type(e).__name__}: {e}") from None
    a = _archive.open_archive(path, expect=here)
    if ns is not None:
        model = a.fingerprint.model or ""
        saved, sep, _ = model.rpartition("#args-")
        if not sep or saved != str(ns.model_path):
            e = _archive.ArchiveMismatch(a.path, "fingerprint.model", str(ns.model_path),
                                         saved or model)
            e.args = (f"archive {a.path}: --model-path {str(ns.model_path)!r} here, "
                      f"{saved or model!r} when it was saved",)  # both paths whole
            raise e
    return a


def _default_region_bytes(device: int) -> int:
    """SAVE's region when ``--region-bytes`` is not given: the GPU's memory (the region is an
    address range: only what the engine allocates is backed by memory)."""
    import vitrify

    from ... import _native

    if not vitrify.cuda_available():
        raise LaunchError(f"--region-bytes: no GPU here to size the region from "
                          f"({vitrify.cuda_unavailable_reason()}); pass --region-bytes SIZE "
                          f"(the engine's whole footprint, e.g. 80GiB)")
    try:
        return int(_native.device_info(device)["total_bytes"])
    except (RuntimeError, ValueError) as e:
        raise LaunchError(f"--region-bytes: GPU {device} (--base-gpu-id): {e}; pass "
                          f"--region-bytes SIZE") from None


# ---------------------------------------------------------------------------------------------
# the plugin's TOML
# ---------------------------------------------------------------------------------------------

# config key -> the option that sets it (for messages)
OPTION_OF = {"region_bytes": "--region-bytes", "on_mismatch": "--on-mismatch",
             "standby_file": "--standby-file", "read_ahead": "--no-read-ahead",
             "weight_updates": "--weight-updates", "jit_caches": "--no-jit-caches",
             "jit_dir": "--jit-dir", "save_after_requests": "--save-after-requests",
             "warmup_requests": "--warmup-requests", "shape_sweep": "--no-shape-sweep",
             "sweep_max_batch": "--sweep-max-batch", "archive": "ARCHIVE"}


def plugin_table(mode: str, archive: str, region_bytes: int, opts: argparse.Namespace) -> dict:
    """The plugin's config for ``mode``: the keys the mode needs and every option given."""
    data: dict[str, Any] = {"mode": mode, "archive": archive, "region_bytes": region_bytes}
    for key in ("on_mismatch", "standby_file", "warmup_requests", "read_ahead"):
        if mode == "load" and getattr(opts, key, None) is not None:
            data[key] = getattr(opts, key)
    for key in ("save_after_requests", "shape_sweep", "sweep_max_batch"):
        if mode == "save" and getattr(opts, key, None) is not None:
            data[key] = getattr(opts, key)
    for key in ("weight_updates", "jit_caches", "jit_dir"):
        if getattr(opts, key, None) is not None:
            data[key] = getattr(opts, key)
    for key in ("archive", "standby_file", "jit_dir"):
        if key in data:
            data[key] = os.path.abspath(os.path.expanduser(data[key]))
    return data


def validate(data: Mapping[str, Any]) -> _config.PluginConfig:
    """``data`` through the plugin's own validation; a problem names the option."""
    try:
        return _config.from_mapping(data)
    except _config.PluginConfigError as e:
        text = str(e)
        m = re.search(r"config key '(\w+)'", text)
        if m and m.group(1) in OPTION_OF:
            text = f"{OPTION_OF[m.group(1)]}: {text}"
        raise LaunchError(text) from None


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise LaunchError(f"{OPTION_OF.get(key, key)}: {value!r} is not UTF-8 text (the "
                              f"plugin reads a TOML file)") from None
        # a JSON string is a TOML basic string once DEL, which TOML wants escaped, is
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"config key {key!r}: no TOML form for {type(value).__name__}")


def render_toml(data: Mapping[str, Any], command: str, where: str) -> str:
    """The TOML text of ``data``, with a header saying what wrote it and where it goes."""
    import vitrify

    lines = [f"# vitrify sglang {command} (vitrify {vitrify.__version__}): the SGLang plugin's "
             f"config ({state.CONFIG_ENV}), {' '.join(where.split())}"]  # a comment: one line
    lines += [f"{key} = {_toml_value(key, value)}" for key, value in data.items()]
    return "\n".join(lines) + "\n"


def config_dir(create: bool = True) -> str:
    """``<tempdir>/vitrify-<uid>/sglang``: created 0700; refused when it (or its parent) is a
    link, another user's, or writable by others. ``create=False``: only the path."""
    root = os.path.join(tempfile.gettempdir(), f"vitrify-{os.geteuid()}")
    if not create:
        return os.path.join(root, "sglang")
    for path in (root, os.path.join(root, "sglang")):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise LaunchError(f"cannot create {path} for the plugin's config: "
                              f"{e.strerror}") from None
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise LaunchError(f"{path} is not a directory (a link or a file): the plugin's "
                              f"config is not written there (set TMPDIR elsewhere)")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise LaunchError(f"{path} belongs to uid {st.st_uid} or others can write it: the "
                              f"plugin's config is not written there (set TMPDIR elsewhere)")
    return path


def config_path(archive: str, mode: str, create: bool = True) -> str:
    """Where the TOML for ``archive`` in ``mode`` goes (one file per archive and mode);
    ``create``: make its directory (:func:`config_dir`)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(archive.rstrip("/")))[:64] or "archive"
    digest = hashlib.sha256(archive.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(config_dir(create), f"{name}.{mode}.{digest}.toml")


def write_config(path: str, text: str) -> _config.PluginConfig:
    """Write ``text`` to ``path`` atomically (0600), then read it back the way the plugin
    will (``config.load``)."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".toml.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise LaunchError(f"cannot write the plugin's config {path}: {e.strerror}") from None
    try:
        return _config.load(path)
    except _config.PluginConfigError as e:
        raise LaunchError(f"the plugin's config as written: {e}") from None


# ---------------------------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------------------------


def command_line(argv: list[str]) -> list[str]:
    """SGLang's launcher with ``argv`` unchanged, run by this Python."""
    return [sys.executable, *LAUNCHER, *argv]


def _plan(command: str, archive_arg: str, opts: argparse.Namespace, argv: list[str],
          env: Mapping[str, str]) -> tuple[str, dict, str]:
    """Check everything that can be checked here, the cheap checks first; return (mode,
    config table, what to say)."""
    version = sglang_version()
    archive = os.path.abspath(os.path.expanduser(archive_arg))
    mode = command if command != "serve" else "load" if os.path.lexists(archive) else "save"
    if mode == "save":
        if os.path.lexists(archive):
            raise LaunchError(f"{archive} exists: save writes a new archive (remove the old one "
                              f"or choose another path; vitrify sglang serve LOADs it)")
        parent = os.path.dirname(archive)
        if not os.path.isdir(parent):
            raise LaunchError(f"{parent} is not a directory: save writes the archive there")
    elif not os.path.isdir(archive):
        what = "is not a directory" if os.path.lexists(archive) else "does not exist"
        raise LaunchError(f"{archive} {what}: load reads an archive written by vitrify sglang "
                          f"save (vitrify sglang serve saves one when there is none)")
    problems = environment_problems(env)
    ver = release(version)
    ns = None if opts.no_check else parse_server_args(argv, ver)
    if ns is not None:
        problems += server_problems(ns, env, ver)
    if problems:
        raise LaunchError("vitrify would refuse this server: " + "; ".join(problems))
    device = int(getattr(ns, "base_gpu_id", 0) or 0) if ns is not None else 0
    if mode == "save":
        if opts.region_bytes is None:
            size = _default_region_bytes(device)
        else:
            try:
                size = _config.parse_size("region_bytes", opts.region_bytes)
            except _config.PluginConfigError as e:
                raise LaunchError("--region-bytes: " + str(e).replace(
                    "config key 'region_bytes': ", "")) from None
        said = f"SAVE to {archive} (region {size / 2**30:.1f} GiB)"
        if command == "serve":
            said = f"no archive at {archive}: SGLang starts as usual, then " + said
        return mode, plugin_table(mode, archive, size, opts), said
    from ... import archive as _archive

    try:
        a = open_matching(archive, ns, version, device)
        said = f"LOAD from {archive}"
    except _archive.ArchiveMismatch as e:
        if (opts.on_mismatch or "refuse") == "refuse":
            hint = "remove it to save a new one, or " if command == "serve" else ""
            raise LaunchError(f"the archive does not match this server: {e} ({hint}"
                              f"--on-mismatch cold-start starts it cold)") from None
        a = _archive.open_archive(archive)
        said = (f"LOAD from {archive}: it does not match ({e}); on_mismatch cold-start: the "
                f"server starts cold")
    except (_archive.ArchiveError, OSError) as e:
        raise LaunchError(f"the archive cannot be read: {e} (vitrify verify {archive} checks "
                          f"every file)") from None
    # LOAD reserves the archive's own region; the plugin's config states its size
    return mode, plugin_table(mode, archive, a.region.size, opts), said


def run_command(command: str, opts: argparse.Namespace, argv: list[str] | None,
                env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` (one of ``COMMANDS``) with vitrify's options ``opts`` and SGLang's
    arguments ``argv`` (what followed ``--``). save/load/serve do not return unless
    ``--dry-run`` (0) or refused (:class:`LaunchError`)."""
    env = os.environ if env is None else env
    if argv is None:
        raise LaunchError(f"give SGLang's server arguments after --, e.g. vitrify sglang "
                          f"{command} {'' if command == 'check' else 'ARCHIVE '}-- --model-path "
                          f"MODEL --attention-backend triton --random-seed 1")
    if command == "check":
        return check(opts, argv, env)
    mode, data, said = _plan(command, opts.archive, opts, argv, env)
    validate(data)
    cmd = command_line(argv)
    if opts.dry_run:  # nothing is created
        path = config_path(data["archive"], mode, create=False)
        print(render_toml(data, command, f"to be written to {path}"), end="")
        print(f"# {said}; then this process becomes SGLang's launcher (exec):")
        print(shlex.join([f"{state.CONFIG_ENV}={path}", *cmd]))
        return 0
    path = config_path(data["archive"], mode)
    write_config(path, render_toml(data, command, f"written to {path}"))
    print(f"vitrify sglang {command}: {said} (config {path})", file=sys.stderr)
    child = dict(env)
    child[state.CONFIG_ENV] = path
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, child)
    except OSError as e:
        raise LaunchError(f"cannot start {cmd[0]}: {e.strerror}", status=1) from None
    return 1  # not reached: exec replaced this process


def check(opts: argparse.Namespace, argv: list[str], env: Mapping[str, str]) -> int:
    """``vitrify sglang check``: exit 0 and what vitrify changes when it would run this server;
    1 and one line naming every refusal when it would not."""
    version = sglang_version()
    ver = release(version)
    ns = parse_server_args(argv, ver)
    problems = environment_problems(env) + server_problems(ns, env, ver)
    if opts.archive is not None and not problems:
        from ... import archive as _archive

        try:
            open_matching(os.path.abspath(os.path.expanduser(opts.archive)), ns, version,
                          int(ns.base_gpu_id or 0))
        except (_archive.ArchiveError, OSError) as e:
            problems.append(f"--archive: {e}")
    if problems:
        raise LaunchError("vitrify would refuse this server: " + "; ".join(problems), status=1)
    print(f"vitrify can freeze and thaw this server (SGLang {version}); nothing is refused.")
    for mode in ("save", "load"):
        diffs, said = changes(ns, mode, ver)
        print(f"{mode.upper()} changes: {'; '.join(diffs) if diffs else 'no argument'}")
        for line in said:
            print(f"  {line}")
    if opts.archive is not None:
        print(f"--archive {opts.archive}: engine, versions, GPU and model path match; the plugin "
              f"compares every engine-shaping argument when LOAD opens it")
    return 0


# ---------------------------------------------------------------------------------------------
# the command line (vitrify.cli wires it in)
# ---------------------------------------------------------------------------------------------

_EPILOG = ("SGLang's arguments follow --, unchanged. Before SGLang starts every refusal is one "
           "line, exit status 2. See PLUGIN.md in vitrify.integrations.sglang.")


def add_parser(sub: Any) -> None:
    """``vitrify sglang SUBCOMMAND``, in the subparsers ``sub`` of the ``vitrify`` command."""
    s = sub.add_parser("sglang", help="run an SGLang server under vitrify: save, load, serve, "
                                      "check (SGLang's arguments after --)",
                       description="Run SGLang's own launcher with vitrify's plugin configured, "
                                   "or check a command line. " + _EPILOG)
    ssub = s.add_subparsers(dest="sglang_command", required=True)
    helps = {
        "save": "start SGLang as usual, then freeze the served engine into ARCHIVE (a new one)",
        "load": "start SGLang thawed from ARCHIVE",
        "serve": "LOAD from ARCHIVE when it exists and matches, else start as usual and SAVE "
                 "there",
        "check": "say what vitrify would refuse or change in an SGLang command line (no GPU "
                 "needed; exit 0: runs, 1: refused)",
    }
    for name in COMMANDS:
        usage = "%(prog)s [options] " + ("" if name == "check" else "ARCHIVE ") + \
            "-- SGLANG_SERVER_ARGS..."
        p = ssub.add_parser(name, help=helps[name], usage=usage,
                            description=helps[name] + ". " + _EPILOG)
        if name == "check":
            p.add_argument("--archive", default=None,
                           help="also compare this archive with the command (what can be "
                                "compared without starting SGLang)")
            continue
        p.add_argument("archive", metavar="ARCHIVE", help="the archive directory")
        if name in ("save", "serve"):
            p.add_argument("--region-bytes", default=None, metavar="SIZE",
                           help="SAVE: the region every engine allocation goes to, bytes or "
                                "e.g. 80GiB (default: the GPU's memory; LOAD uses the "
                                "archive's)")
            p.add_argument("--save-after-requests", type=int, default=None, metavar="N",
                           help="SAVE: write the archive at the first idle moment after N "
                                "generate requests (default 1: SGLang's warm-up request)")
            p.add_argument("--no-shape-sweep", dest="shape_sweep", action="store_const",
                           const=False, default=None,
                           help="SAVE: no shape sweep before the archive (LOAD may then "
                                "compile kernels of request shapes SAVE never served)")
            p.add_argument("--sweep-max-batch", type=int, default=None, metavar="N",
                           help="SAVE: the largest batch the shape sweep sends (default 256, "
                                "or the server's max_running_requests where lower)")
        if name in ("load", "serve"):
            p.add_argument("--on-mismatch", choices=_config.ON_MISMATCH, default=None,
                           help="when the archive does not match this server: refuse "
                                "(default) or start cold")
            p.add_argument("--standby-file", default=None, metavar="PATH",
                           help="LOAD: start and import, then wait for this file to exist "
                                "before touching the GPU")
            p.add_argument("--warmup-requests", type=int, default=None, metavar="N",
                           help="LOAD: requests of SAVE's prompt lengths before the server "
                                "reports ready (default 8; 0: none)")
            p.add_argument("--no-read-ahead", dest="read_ahead", action="store_const",
                           const=False, default=None,
                           help="LOAD: do not read the weights span ahead while the scheduler "
                                "imports")
        p.add_argument("--weight-updates", action="store_const", const=True, default=None,
                       help="accept update_weights_from_tensor(load_format=\"vitrify\")")
        p.add_argument("--no-jit-caches", dest="jit_caches", action="store_const", const=False,
                       default=None, help="do not pack (SAVE) or unpack (LOAD) the JIT caches")
        p.add_argument("--jit-dir", default=None, metavar="DIR",
                       help="where SAVE points the JIT caches / LOAD unpacks them (default: "
                            "ARCHIVE.jit-work / under ~/.cache/vitrify/jit)")
        p.add_argument("--dry-run", action="store_true",
                       help="print the plugin's config and the command line, start nothing")
        p.add_argument("--no-check", action="store_true",
                       help="do not parse SGLang's arguments here (saves SGLang's import "
                            "time); the plugin still refuses them when the server starts")


def split_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``vitrify sglang ...`` split at its first ``--``: vitrify's part, SGLang's (None when
    there is no ``--``). Any other command line is returned whole."""
    if argv and argv[0] == "sglang" and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


__all__ = ["COMMANDS", "LAUNCHER", "LaunchError", "OPTION_OF", "add_parser", "changes", "check",
           "command_line", "config_dir", "config_path", "environment_problems", "open_matching",
           "parse_server_args", "plugin_table", "release", "render_toml", "run_command",
           "server_problems", "sglang_version", "split_argv", "validate", "write_config"]
