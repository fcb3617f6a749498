"""rpcx's command line: ``python -m rpcx`` or ``rpcx``.

- ``backends [--names | --wide]``: the installed backends and what they can do;
- ``doctor [--init-method URL]``: what this machine has for rpcx, each problem with what
  to do about it (exit status 1 if there is one);
- ``launch -n N [--backend B] script.py [args]``: N workers of a script on this host,
  torchrun's variables set, output prefixed by worker, Ctrl-C stops them all;
- ``trace merge DIR -o OUT.json``: one Chrome trace (Perfetto, chrome://tracing) of the
  workers' ``*.rpcx-trace.json`` files in DIR, clocks aligned (exit status 1 if a call's
  steps are still out of order);
- ``trace plot DIR -o OUT.png``: the same timeline as a picture (needs matplotlib);
- ``trace otel DIR [--endpoint URL]``: the same calls as OpenTelemetry spans, sent over
  OTLP or printed one JSON object a line (needs opentelemetry-sdk);
- ``bench [args]``: the benchmark suite against torch.distributed.rpc (``bench/run.py``
  of a source checkout).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

__all__ = ["main"]


def _bench(args: list[str]) -> int:
    # bench/ is part of the repository, not of the installed package: look for it next to
    # the package (an editable install) and in the working directory.
    here = pathlib.Path(__file__).resolve().parents[2]
    for root in (here, pathlib.Path.cwd()):
        script = root / "bench" / "run.py"
        if script.is_file():
            return subprocess.call([sys.executable, str(script), *args], cwd=root)
    print("rpcx bench: bench/run.py not found; it ships with rpcx's source repository "
          "(run this from a checkout, or: python bench/run.py)", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m rpcx`` and the ``rpcx`` script."""
    # (the docstring is reST for the API pages; a terminal shows it without the markup)
    description = (__doc__ or "").replace("``", "")
    parser = argparse.ArgumentParser(prog="rpcx", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list the installed backends")
    backends_layout = backends.add_mutually_exclusive_group()
    backends_layout.add_argument("--names", action="store_true",
                                 help="print one name per line")
    backends_layout.add_argument("--wide", action="store_true",
                                 help="one line per backend (a table wider than 80 columns)")
    doctor = commands.add_parser("doctor", help="check this machine for rpcx")
    doctor.add_argument("--init-method", help="a rendezvous URL to check the path to "
                        "(default: env:// if MASTER_ADDR is set)")
    launch = commands.add_parser("launch", help="start N workers of a script on this host")
    launch.add_argument("-n", "--nprocs", type=int, required=True, help="how many workers")
    launch.add_argument("--backend", help="sets $RPCX_BACKEND for the workers")
    launch.add_argument("script", help="the Python script each worker runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    trace = commands.add_parser("trace", help="merge, plot or export the workers' trace "
                                "files")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True,
                                          metavar="{merge,plot,otel}")
    trace_merge = trace_commands.add_parser("merge", help="write one Chrome trace of DIR")
    trace_merge.add_argument("directory", metavar="DIR", help="the *.rpcx-trace.json files")
    trace_merge.add_argument("-o", "--output", required=True, metavar="OUT.json",
                             help="the merged trace to write")
    trace_plot = trace_commands.add_parser("plot", help="draw DIR's timeline as a PNG")
    trace_plot.add_argument("directory", metavar="DIR", help="the *.rpcx-trace.json files "
                            "(or a merged trace)")
    trace_plot.add_argument("-o", "--output", required=True, metavar="OUT.png",
                            help="the picture to write")
    trace_plot.add_argument("--title", help="the plot's title")
    trace_otel = trace_commands.add_parser("otel", help="export DIR as OpenTelemetry spans")
    trace_otel.add_argument("directory", metavar="DIR", help="the *.rpcx-trace.json files")
    trace_otel.add_argument("--endpoint", metavar="URL", help="an OTLP collector: gRPC "
                            "(http://localhost:4317), HTTP if it ends in /v1/traces "
                            "(needs opentelemetry-exporter-otlp); default: print the spans")
    trace_otel.add_argument("--service-name", default="rpcx", help="the spans' service.name "
                            "(default: rpcx)")
    commands.add_parser("bench", help="run the benchmark suite (bench/run.py), arguments "
                        "passed on", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "backends":
        from rpcx.cli.backends import list_backends

        return list_backends(args.names, args.wide)
    if args.command == "doctor":
        from rpcx.cli.doctor import doctor as run_doctor

        return run_doctor(args.init_method)
    if args.command == "launch":
        from rpcx.cli.launch import launch_script

        return launch_script(args.nprocs, args.script, args.script_args, args.backend)
    if args.command == "trace":
        from rpcx.cli.trace import merge_command, otel_command, plot_command

        if args.trace_command == "merge":
            return merge_command(args.directory, args.output)
        if args.trace_command == "otel":
            return otel_command(args.directory, args.endpoint, args.service_name)
        return plot_command(args.directory, args.output, args.title)
    return 2  # pragma: no cover - argparse rejects unknown commands
