"""README.md holds as written: its Python snippets run and do what their comments say, every
`mcsd-generate` / `mcsd-serve` line it shows parses, and it stays a guide (the reference is in docs/)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
SERVER_NOTE = "# needs a running `mcsd-serve --port 8000`"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def command_lines(program: str) -> list[list[str]]:
    """Each `program ...` line of README's bash blocks as argv (comments and continuations handled)."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if not re.match(rf"\s*(\S+ \| )?{program} ", line):
                continue
            words = shlex.split(line, comments=True)
            found.append(words[words.index(program) + 1:])
    return found


def test_readme_is_a_guide_and_links_what_it_dropped():
    assert len(README.splitlines()) <= 300
    for ref in ("docs/cli.md", "docs/server.md", "docs/python.md", "docs/benchmarks.md", "docs/design.md"):
        assert ref in README and (REPO / ref).is_file(), ref


def test_every_generate_line_in_readme_parses(tmp_path, monkeypatch):
    from mcsd.cli.args import build_parser, check_args, drafter_kinds
    from mcsd.drafting.policies import POLICIES, resolve_policy
    from mcsd.loading.presets import PRESETS
    monkeypatch.chdir(tmp_path)                          # where `--output results.jsonl` would go
    lines = command_lines("mcsd-generate")
    assert len(lines) >= 5
    for argv in lines:
        args = build_parser().parse_args(argv)          # a typo in a flag exits here
        args.policy = resolve_policy(args.policy, lossy=args.lossy_target_roots > 0,    # as the run does
                                     drafting=not args.baseline and not drafter_kinds(args)[2])
        args.tree = args.tree or POLICIES[args.policy].default_tree
        if args.target is None or args.target in PRESETS:   # the reader's own models are not here
            check_args(args)                              # values are checked before anything loads


def test_every_serve_line_in_readme_parses():
    from mcsd.serve.cli import build_parser
    lines = command_lines("mcsd-serve")
    assert lines
    for argv in lines:
        build_parser().parse_args(argv)


def test_the_python_snippets_are_the_ones_tested_here():
    """The slow tests below run README's snippets; this one fails first if their number or markers change."""
    snippets = blocks("python")
    assert len(snippets) == 3 and snippets[0].startswith(SERVER_NOTE)
    assert "load_model_pair" in snippets[1] and "dec.generate(" in snippets[2]


@pytest.mark.slow
def test_the_python_api_snippets_run_as_written(monkeypatch):
    """The two API snippets, in one namespace as a reader runs them: the asserts in them hold (float32
    output equals plain decoding), logprobs come back, and a seed repeats its sampled text."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    api, options = blocks("python")[1:]
    scope: dict = {}
    exec(compile(api, "README.md (Python)", "exec"), scope)
    assert scope["out"].text and scope["out"].stats.mean_accepted >= 1.0
    exec(compile(options, "README.md (options)", "exec"), scope)
    sampled = scope["out"]
    again = scope["dec"].generate(scope["prompt"], max_new_tokens=32, seed=0,
                                  generation_config=scope["GenerationConfig"](do_sample=True, temperature=0.7,
                                                                              min_p=0.05))
    assert again.tokens == sampled.tokens                # "the same text for the same seed"


@pytest.mark.slow
def test_the_server_snippet_runs_against_the_served_default(tmp_path):
    from serving import running_server
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with running_server(["--threads", "1"], tmp_path / "server.log") as port:
        snippet = blocks("python")[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env,
                                timeout=600)
    assert result.returncode == 0, result.stderr
    text, tau = result.stdout.rstrip().rsplit(" ", 1)
    assert text.strip() and float(tau) >= 1.0
