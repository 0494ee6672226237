"""The ``wdsvlm`` command line. Exit codes: 0 ok, 1 runtime error, 2 usage error."""

from __future__ import annotations

import logging
import sys

from .. import compat
from ..errors import WdsvlmError
from . import arguments, cloud_report, commands, trace_picture
from .arguments import byte_size

__all__ = ["build_parser", "byte_size", "main"]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def build_parser():
    """The ``wdsvlm`` parser: the commands of ``arguments.py``, ``plan-cloud`` and ``trace``."""
    parser = arguments.build_parser()
    cloud_report.add_parser(compat.subcommands(parser))
    trace_picture.add_parser(compat.subcommands(parser))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # other libraries' logs at WARNING; wdsvlm's at the level asked for
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.getLogger("wdsvlm").setLevel(level)
    run = {
        "write": commands.write,
        "verify": commands.verify,
        "index": commands.index,
        "inspect": commands.inspect,
        "stats": commands.stats,
        "bench": commands.bench,
        "plan-cloud": cloud_report.run,
        "trace": commands.trace,
    }[args.command]
    try:
        run(args)
    except WdsvlmError as e:  # bad data, a failed read or write, a dataset not as it should be
        if args.verbose:
            raise
        print(f"wdsvlm {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # an argument: a path, key, tokenizer, value
        if args.verbose:
            raise
        print(f"wdsvlm {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (OSError, ImportError) as e:
        if args.verbose:
            raise
        print(f"wdsvlm {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"wdsvlm {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
