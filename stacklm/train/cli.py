"""``stacklm-train fit --config <name or path>`` (or ``python -m trainer fit`` from the
repository): LightningCLI over ``GPTModule``.

``--config demo`` / ``--config stack-100m`` name the packaged configs (``stacklm.configs``);
any other value is a YAML path. The datamodule class is imported by its dotted path only when
the CLI starts, so the model side works (and is testable) on its own.
``STACKLM_DATAMODULE=pkg.module.Class`` swaps in another ``LightningDataModule`` with the same
batch contract (e.g. a tiny one in a demo).

Errors: a user error (a config key or value jsonargparse refuses, a ``StackLMError`` from the
datamodule, an ``OSError``, a missing optional package) ends in one line,
``stacklm-train <subcommand>: error: <message>``, and exit status 2, as in ``stacklm``;
``--debug`` (anywhere on the command line) shows the traceback instead.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from stacklm.errors import ConfigError, ResumeRefused, StackLMError, is_user_error, lightning_config_error, user_error_message
from stacklm.once import one_line_warnings

DEFAULT_DATAMODULE = "stacklm.datamodule.StackDataModule"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def condense_parser_error(message: str, known: Sequence[str] = ()) -> str:
    """jsonargparse's multi-line message as one line: the key, and the reason of the first
    subtype that is not ``None`` (``Optional[X]`` fields list both); for an unknown option the
    nearest accepted name from ``known``."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return message
    head = re.sub(r'^Parser key "([^"]+)":', r"\1:", lines[0])
    reasons: list[str] = []
    in_errors = False
    for line in lines[1:]:
        if line.startswith(("Subtypes:", "Given value")):
            in_errors = False
            continue
        if line == "Errors:":
            in_errors = True
            continue
        if in_errors and line.startswith("- "):
            reasons.append(line[2:])
        elif in_errors and reasons:
            reasons[-1] += " " + line
        elif not in_errors and not line.startswith("Does not validate"):
            reasons.append(line)
    reasons = [re.sub(r"^Not of type \w+: ", "", r) for r in reasons if not r.startswith("Expected a <class 'NoneType'>")]
    text = f"{head} {reasons[0]}" if reasons else head
    m = re.search(r"Group '([^']+)' does not accept option '([^']+)'", text) or re.search(r"Key '([^']+)\.([^'.]+)' is not expected", text)
    if m and known:
        group = m.group(1)
        names = [k[len(group) + 1 :] for k in known if k.startswith(group + ".")]
        near = difflib.get_close_matches(m.group(2), names, n=1)
        if near:
            text += f"; did you mean '{group}.{near[0]}'?"
    elif (m := re.search(r"Option '([^']+)' is not accepted", text)) and known:  # a class's init_args
        near = difflib.get_close_matches(m.group(1), [k for k in known if "." not in k and k != "help"], n=1)
        if near:
            text += f"; did you mean '{near[0]}'?"
    return text


def import_class(path: str) -> type:
    """``"pkg.module.Class"`` -> the class, with an error that names the path."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"expected a dotted class path like {DEFAULT_DATAMODULE!r}, got {path!r}")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"cannot import datamodule class {path!r}: {err}") from err


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (or ``--config=NAME``) that is not a file replaced by
    the packaged config of that name; anything else is left for LightningCLI to report."""
    from stacklm.configs import packaged_configs, resolve_config

    def fix(value: str) -> str:
        name = value[: -len(".yaml")] if value.endswith(".yaml") else value
        if Path(value).exists() or name not in packaged_configs():
            return value
        return str(resolve_config(name))

    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = fix(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + fix(arg[len("--config="):])
    return out


def cli_main(args=None, datamodule_class: type | None = None, run: bool = True):
    """Build (and by default run) the CLI; ``args`` as for ``LightningCLI`` (None: sys.argv)."""
    from lightning.pytorch.cli import LightningCLI

    from stacklm.train.gpt_module import GPTModule

    quiet_third_party_notices()
    one_line_warnings()
    if datamodule_class is None:
        datamodule_class = import_class(os.environ.get("STACKLM_DATAMODULE", DEFAULT_DATAMODULE))
    if args is None:  # LightningCLI reads sys.argv itself (and DDP re-runs it for the other ranks)
        sys.argv[1:] = resolve_config_args(sys.argv[1:])
    elif isinstance(args, (list, tuple)):
        args = resolve_config_args(args)
    return _cli_class()(
        GPTModule,
        datamodule_class,
        args=args,
        run=run,
        auto_configure_optimizers=False,  # GPTModule.configure_optimizers owns AdamW + schedule
        save_config_kwargs={"overwrite": True},
        parser_class=_parser_class(),
        # Lightning's default (True) seeds with 0 after warning "No seed found"; say 0 outright.
        seed_everything_default=0,
    )


def _cli_class() -> type:
    """``LightningCLI`` whose default logger (``trainer.logger`` unset or ``true``) is the
    ``CSVLogger`` under ``default_root_dir`` that Lightning falls back to anyway when
    TensorBoard is not installed -- chosen here, so the trainer does not warn about
    ``tensorboardX`` having been removed from its dependencies on every fit."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger

    class StackCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            # The shared layout's prebuild settings: validated here (the prebuild's schema),
            # otherwise ignored by the trainer, so one file serves both commands.
            from stacklm.prebuild.settings import prebuild_spec_type

            parser.add_argument("--prebuild", type=prebuild_spec_type() | None, default=None,
                                help="the `stacklm prebuild` settings of this config (out, tokens_per_shard, workers, "
                                "splits); ignored by the trainer")

        def _parse_ckpt_path(self) -> None:
            # LightningCLI torch.loads --ckpt_path here (for its hyperparameters), before the fit
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            check_ckpt_path(ckpt_path)
            try:
                super()._parse_ckpt_path()
            except StackLMError:
                raise
            except Exception as e:  # a zip archive torch cannot read: damaged, or not a checkpoint
                raise ConfigError(
                    f"--ckpt_path {ckpt_path}: torch cannot read this checkpoint ({type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}); it is damaged "
                    "or not one the trainer wrote: pass another .ckpt file (e.g. the previous one), or 'last'"
                ) from e

        def before_instantiate_classes(self) -> None:
            # A resume continues the run's W&B run and CSV folder (stacklm.run_identity): the
            # loggers must be built with the ids the checkpoint keeps, before the trainer opens them.
            from stacklm.run_identity import continue_logger_config, saved_run

            subcommand = self.config.get("subcommand")
            self._saved_run = saved_run(self.config[subcommand].get("ckpt_path")) if subcommand == "fit" else {}
            trainer_cfg = self.config[subcommand].get("trainer") if subcommand else None
            if self._saved_run and trainer_cfg is not None and trainer_cfg.get("logger") not in (None, True):
                trainer_cfg["logger"] = continue_logger_config(trainer_cfg["logger"], self._saved_run,
                                                               trainer_cfg.get("default_root_dir"))

        def _run_subcommand(self, subcommand: str) -> None:
            # A run that fails before it has written anything but its start files (a refused
            # setting, a refused resume, a data gate) leaves no log folder of its own behind.
            new_dirs = _new_log_dirs(self.trainer)
            try:
                super()._run_subcommand(subcommand)
            except Exception:
                _remove_start_only(new_dirs)
                raise

        def _instantiate_trainer(self, config, callbacks):
            from stacklm.run_identity import RunIdentity, continue_logger_config

            if config.get("logger") in (None, True):  # Trainer(logger=None) is its default logger too
                root = config.get("default_root_dir") or os.getcwd()
                logger = continue_logger_config(None, getattr(self, "_saved_run", {}), root)
                config = {**config, "logger": logger if logger is not None else CSVLogger(save_dir=root)}
            if not any(isinstance(cb, RunIdentity) for cb in [*(config.get("callbacks") or []), *callbacks]):
                callbacks = [*callbacks, RunIdentity()]  # every checkpoint keeps the run's logger ids
            extra = _progress_bar(config, callbacks)
            if any(type(cb).__name__ == "ModelSummary" for cb in extra):
                # ours stands for Lightning's default: without this it says it skipped adding one
                config = {**config, "enable_model_summary": False}
            callbacks = [*callbacks, *extra]
            return super()._instantiate_trainer(config, callbacks)

    return StackCLI


# What a fit writes into its log folder before its first step: LightningCLI's config copy and
# the logger's hyperparameters. A folder holding only these is the trace of a failed start.
_START_FILES = ("config.yaml", "hparams.yaml")


def _new_log_dirs(trainer) -> list[Path]:
    """The file loggers' folders this run is about to create (and their parents that do not
    exist yet, then ``default_root_dir`` if it does not), deepest first. A folder that exists
    already (a resume continuing its CSV version) is not among them."""
    out: list[Path] = []
    roots = [getattr(logger, "log_dir", None) for logger in trainer.loggers if type(logger).__name__ != "WandbLogger"]
    for root in [*roots, trainer.default_root_dir]:
        if not isinstance(root, str):
            continue
        d = Path(root).absolute()
        while not d.exists() and d not in out:
            out.append(d)
            d = d.parent
    return sorted(out, key=lambda p: len(p.parts), reverse=True)


def _remove_start_only(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` that holds nothing but ``_START_FILES`` (deepest first, so a
    parent emptied by its child goes too); a folder with anything else in it is kept."""
    for d in dirs:
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        if all(e.is_file() and e.name in _START_FILES for e in entries):
            try:
                for e in entries:
                    e.unlink()
                d.rmdir()
            except OSError:
                pass  # another process wrote there meanwhile: keep it


def _progress_bar(config, callbacks, terminal: bool | None = None) -> list:
    """The default bar, when the trainer would add Lightning's: on a terminal ``StepProgressBar``
    (no ``Epoch 0/-2``, ``global_step`` of ``max_steps`` after a resume too); where stderr is not
    one (``nohup``, Slurm, ``2> log``) ``LineProgressBar``'s plain lines (``STACKLM_PROGRESS``
    chooses either: ``stacklm.progress_lines.wants_lines``). ``terminal``: whether stderr is one
    (None: ask). A bar the config names is kept as it is.

    The choice is put in ``STACKLM_PROGRESS``, so the ranks Lightning starts for DDP make the
    same one: the line bar's counts are collectives, which every rank must join.

    In lines mode the model summary is Lightning's plain ``ModelSummary`` too: the trainer adds
    ``RichModelSummary`` whenever Rich is installed, and a log got its box-drawn table."""
    import importlib.util

    from lightning.pytorch.callbacks import ModelSummary, ProgressBar

    from stacklm.progress_lines import STYLE_ENV, wants_lines

    given = [*(config.get("callbacks") or []), *callbacks]
    lines = wants_lines() if terminal is None else not terminal
    summary = [] if not lines or config.get("enable_model_summary") is False or any(isinstance(cb, ModelSummary) for cb in given) \
        else [ModelSummary()]
    if config.get("enable_progress_bar") is False or any(isinstance(cb, ProgressBar) for cb in given):
        return summary
    from stacklm.train.progress import LineProgressBar, StepProgressBar

    if terminal is None:
        os.environ[STYLE_ENV] = "lines" if lines else "bar"
    if lines:
        return [LineProgressBar(), *summary]
    if importlib.util.find_spec("rich") is None:
        return []  # Lightning's default is the tqdm bar (which prints no epoch bound)
    return [StepProgressBar()]


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Refuse a ``--ckpt_path`` that is no checkpoint before Lightning loads it (a junk file
    ended in torch's unpickler traceback). Lightning's keywords (``last``, ``best``, ...) and
    remote URLs pass; a local file must be the zip archive ``torch.save`` writes."""
    import zipfile

    if ckpt_path is None or str(ckpt_path) in ("last", "best", "hpc", "registry") or "://" in str(ckpt_path):
        return
    path = Path(str(ckpt_path))
    if not path.exists():
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such checkpoint file; pass a .ckpt file written by the trainer, or 'last'")
    if path.is_dir():
        raise ConfigError(f"--ckpt_path {ckpt_path}: is a directory; pass a .ckpt file inside it (e.g. last.ckpt)")
    try:
        with zipfile.ZipFile(path) as z:
            ok = any(name.endswith("/data.pkl") or name == "data.pkl" for name in z.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: not a PyTorch checkpoint (not the zip archive torch.save writes; truncated "
            "or another file); pass a .ckpt file written by the trainer (ModelCheckpoint), or 'last'"
        )


class _NoAdvert(logging.Filter):
    """Drops Lightning's "💡 Tip: ... try installing litlogger/litmodels" lines: advertising
    for hosted services, printed on every fit, with nothing for a stacklm user to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("💡 Tip:")


def quiet_third_party_notices() -> None:
    """Silence, by exact message, the lines a fit printed that are neither ours nor true of it
    (issue 25). What could be fixed at its cause was (the optimizer ``betas`` round-trip warning:
    ``stacklm.config.Config``; "No seed found": ``seed_everything_default``; the tensorboardX
    notice: the default logger above). What is left is third-party code talking about itself:

    - Lightning's ``_pytree`` builds ``LeafSpec()``, which torch >= 2.10 deprecates
      (``FutureWarning``, once per fit, from inside ``CombinedLoader``; no caller can avoid it);
    - the litlogger/litmodels tips (``_NoAdvert``).

    Lightning's "IterableDataset has __len__ ... duplicate data" warning is handled where our
    loaders are built (``stacklm.datamodule.stack_datamodule``), which documents why the length is exact.
    """
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoAdvert) for f in log.filters):
            log.addFilter(_NoAdvert())


def _parser_class() -> type:
    """LightningCLI's parser, raising ``ConfigError`` (one line) where jsonargparse would
    print its usage and a multi-line message; ``--help`` and ``--print_config`` still exit 0."""
    from lightning.pytorch.cli import LightningArgumentParser

    class StackArgumentParser(LightningArgumentParser):
        def error(self, message: str, ex: Exception | None = None):
            parsers = [self, *getattr(getattr(self, "_subcommands_action", None), "choices", {}).values()]
            known = [a.dest for p in parsers for a in p._actions if isinstance(getattr(a, "dest", None), str)]
            config = [str(c) for c in _config_paths(sys.argv[1:] if _ARGS is None else _ARGS)]
            where = f"{', '.join(config)}: " if config else ""
            text = condense_parser_error(message, known)
            # a nested parser (a class's init_args) raised one of ours already: keep its text once
            text = text.replace(_HINT, "").replace(where, "").strip()
            raise ConfigError(f"{where}{text}{_HINT}") from ex

    return StackArgumentParser


_HINT = " (`--help` lists the options; --debug shows the traceback)"
_ARGS: list[str] | None = None  # the arguments being parsed, for naming the config files in errors


def _config_paths(args: Sequence[str]) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith("--config="):
            out.append(arg[len("--config="):])
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """The ``stacklm-train`` console script (and ``python -m trainer``): a user error exits 2
    with one line; ``--debug`` keeps its traceback."""
    global _ARGS
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:  # an environment variable, so that DDP's other ranks see it too
        os.environ["STACKLM_DEBUG"] = "1"
    debug = os.environ.get("STACKLM_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    _ARGS = resolve_config_args(args)
    try:
        if argv is None:
            sys.argv[1:] = _ARGS
            cli_main()
        else:
            cli_main(_ARGS)
    except Exception as e:
        if debug or not is_user_error(e):
            raise
        command = next((a for a in args if a in SUBCOMMANDS), "")
        text = user_error_message(e)
        config = _config_paths(_ARGS or [])
        # a refused resume is about the checkpoint and the data, not a value of the config: no config prefix
        if ((isinstance(e, ConfigError) and not isinstance(e, ResumeRefused) or lightning_config_error(e) is not None)
                and config and not text.startswith("--") and not any(c in text for c in config)):
            text = f"{', '.join(config)}: {text}"  # a value of the config (or of its command-line overrides)
        print(f"stacklm-train{' ' + command if command else ''}: error: {text}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
