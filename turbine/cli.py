"""The `turbine` command: serve, frontend, worker, mocker, router, model, planner, profile."""

from __future__ import annotations

import sys

USAGE = """usage: turbine COMMAND [ARGS]   (turbine --version: the installed version)

commands:
  serve      frontend + one vLLM worker on this machine (the embedded default model unless --model)
  frontend   the OpenAI-compatible HTTP frontend (same as python -m turbine.frontend)
  worker     a vLLM worker (same as python -m turbine.vllm)
  mocker     simulated vLLM workers, no model (same as python -m turbine.mocker);
             mocker calibrate: measure a running worker and write a timing profile for --profile
  router     the standalone KV router service: best_worker over the request plane
             (same as python -m turbine.router)
  model      prepare [NAME]: fetch and convert an embedded model into the cache
  planner    the SLA planner: sizes the fleet per role to meet TTFT / ITL targets
             (same as python -m turbine.planner)
  profile    sweep a running worker and write the engine profile the planner (and the mocker's
             --profile) reads (the same sweep as mocker calibrate)

Run 'turbine COMMAND --help' for the flags of a command. serve, frontend, worker, mocker and
router take --config FILE (YAML of flag names); flags win over it, and it wins over TURBINE_*
environment variables. The planner's --config holds its config's field names.
"""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("turbine")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def model_parser():
    import argparse

    from turbine.model.prepare import DEFAULT_MODEL, EMBEDDED_MODELS

    p = argparse.ArgumentParser(prog="turbine model")
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="fetch and convert an embedded model (cached)")
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(EMBEDDED_MODELS),
                      help=f"the embedded model (default {DEFAULT_MODEL}); its folder is printed")
    return p


def _model(argv: list[str]) -> int:
    from turbine.model.prepare import prepare

    args = model_parser().parse_args(argv)
    print(prepare(args.name))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"turbine {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from turbine.serve import main as serve_main

        return serve_main(rest)
    if command == "frontend":
        from turbine.frontend.server import main as frontend_main

        return frontend_main(rest)
    if command == "worker":
        from turbine.vllm.worker import main as worker_main

        return worker_main(rest)
    if command == "mocker" and rest[:1] == ["calibrate"]:
        from turbine.mocker.calibrate import main as calibrate_main

        return calibrate_main(rest[1:])
    if command == "mocker":
        from turbine.mocker.worker import main as mocker_main

        return mocker_main(rest)
    if command == "router":
        from turbine.router.service import main as router_main

        return router_main(rest)
    if command == "model":
        return _model(rest)
    if command == "planner":
        from turbine.planner.service import main as planner_main

        return planner_main(rest)
    if command == "profile":
        from turbine.mocker.calibrate import main as calibrate_main

        return calibrate_main(rest, prog="turbine profile")
    print(f"turbine: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
