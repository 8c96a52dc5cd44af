"""README.md and docs/ hold as written: their Python snippets run and do what their comments say,
every `mcsd-generate` / `mcsd-serve` line they show parses, every `mcsd.` name they give exists, and
README stays a guide (the reference is in docs/)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOCS = {f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
SERVER_NOTE = "# needs a running `mcsd-serve --port 8000`"


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def command_lines(program: str, texts=(README,)) -> list[list[str]]:
    """Each `program ...` line of the texts' bash blocks as argv (comments and continuations handled)."""
    found = []
    for block in (b for text in texts for b in blocks("bash", text)):
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


@pytest.mark.parametrize("where", ["README.md", "docs/"])
def test_every_generate_line_parses(tmp_path, monkeypatch, where):
    from mcsd.cli.args import build_parser, check_args, drafter_kinds
    from mcsd.drafting.policies import POLICIES, resolve_policy
    from mcsd.loading.presets import PRESETS
    monkeypatch.chdir(tmp_path)                          # where `--output results.jsonl` would go
    lines = command_lines("mcsd-generate", (README,) if where == "README.md" else tuple(DOCS.values()))
    assert len(lines) >= 5
    for argv in lines:
        args = build_parser().parse_args(argv)          # a typo in a flag exits here
        args.policy = resolve_policy(args.policy, lossy=args.lossy_target_roots > 0,    # as the run does
                                     drafting=not args.baseline and not drafter_kinds(args)[2])
        args.tree = args.tree or POLICIES[args.policy].default_tree
        if args.target is None or args.target in PRESETS:   # the reader's own models are not here
            check_args(args)                              # values are checked before anything loads


def test_every_serve_line_parses():
    from mcsd.serve.cli import build_parser
    lines = command_lines("mcsd-serve", (README, *DOCS.values()))
    assert len(lines) > len(command_lines("mcsd-serve"))
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
    stats = scope["out"].stats               # the default pair drafts, and the drafts are taken (costs are fixed here)
    assert scope["out"].text and stats.draft_forwards > 0 and stats.accept_by_depth[0] > 0
    assert stats.mean_accepted == len(scope["out"].tokens) / stats.target_forwards > 1.0
    exec(compile(options, "README.md (options)", "exec"), scope)
    sampled = scope["out"]
    again = scope["dec"].generate(scope["prompt"], max_new_tokens=32, seed=0,
                                  generation_config=scope["GenerationConfig"](do_sample=True, temperature=0.7,
                                                                              min_p=0.05))
    assert again.tokens == sampled.tokens                # "the same text for the same seed"


def _metrics(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_the_server_snippets_run_against_the_served_default(tmp_path):
    """README's snippet, then docs/server.md's, against one server with the default pair. The tau
    README's prints is the server's own count for that one request: its tokens over its target forwards."""
    from serving import running_server
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with running_server(["--threads", "1"], tmp_path / "server.log") as port:
        def run(snippet: str) -> str:
            result = subprocess.run([sys.executable, "-c", snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                                    capture_output=True, text=True, env=env, timeout=600)
            assert result.returncode == 0, result.stderr
            return result.stdout

        text, tau = run(blocks("python")[0]).rstrip().rsplit(" ", 1)
        counts = _metrics(port)
        tokens, forwards = counts[("mcsd_completion_tokens_total", ())], counts[("mcsd_target_forwards_total", ())]
        assert text.strip() and 0 < tokens <= 64
        assert float(tau) == pytest.approx(tokens / forwards, abs=1e-4) == counts[("mcsd_tau", ())]

        answer, streamed = run(blocks("python", DOCS["docs/server.md"])[0]).split("\n", 1)
        assert answer.strip() and streamed.strip()
        assert _metrics(port)[("mcsd_requests_total", (("endpoint", "chat"), ("status", "200")))] == 3


def test_every_mcsd_name_in_docs_exists():
    """Each `mcsd.module.name` README and docs/ give is importable (docs/results.md, a dated record,
    keeps the names of its day)."""
    import importlib
    texts = [README, *(text for name, text in DOCS.items() if name != "docs/results.md")]
    names = sorted({m for text in texts for m in re.findall(r"`(mcsd(?:\.\w+)+)", text)})
    assert len(names) >= 20
    missing = []
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert not missing, missing


def test_the_docs_python_snippets_are_the_ones_tested_here():
    """The tests below run every Python snippet in docs/; this one fails first when one is added or moved."""
    counts = {name: len(blocks("python", text)) for name, text in DOCS.items() if blocks("python", text)}
    assert counts == {"docs/eagle3.md": 1, "docs/python.md": 1, "docs/server.md": 1}
    assert "load_model_pair(" in blocks("python", DOCS["docs/eagle3.md"])[0]
    assert "logits_processor=" in blocks("python", DOCS["docs/python.md"])[0]
    assert "127.0.0.1:8000" in blocks("python", DOCS["docs/server.md"])[0]


def test_the_eagle3_snippet_runs_with_a_head_here(tmp_path, capsys):
    """docs/eagle3.md's snippet as written, its two folders swapped for the tiny Llama and EAGLE-3 head of
    tests/fixtures/eagle3 (the 8B pair it names is not here)."""
    import shutil

    from conftest import word_tokenizer
    fixtures = REPO / "tests" / "fixtures" / "eagle3"
    shutil.copytree(fixtures / "target", tmp_path / "target")
    word_tokenizer(vocab=96).save_pretrained(tmp_path / "target")
    snippet = blocks("python", DOCS["docs/eagle3.md"])[0]
    swaps = {"meta-llama/Llama-3.1-8B-Instruct": tmp_path / "target", "heads/eagle3-llama3.1-8b": fixtures / "original"}
    for name, path in swaps.items():
        assert f'"{name}"' in snippet
        snippet = snippet.replace(f'"{name}"', repr(str(path)))
    scope: dict = {}
    exec(compile(snippet, "docs/eagle3.md (Python)", "exec"), scope)
    from mcsd.drafting.eagle3 import Eagle3Drafter
    printed = capsys.readouterr().out.splitlines()
    assert isinstance(scope["drafter"], Eagle3Drafter) and len(printed) == 1 and printed[0].strip()


@pytest.mark.slow
def test_the_generation_options_snippet_runs_as_written(monkeypatch):
    """docs/python.md's snippet on its own: logprobs for each token, and the processor of its own obeyed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    scope: dict = {}
    exec(compile(blocks("python", DOCS["docs/python.md"])[0], "docs/python.md (Python)", "exec"), scope)
    out = scope["out"]
    assert out.text.strip() and not any(c.isdigit() for c in out.text)
    first = scope["dec"].generate(scope["prompt"], max_new_tokens=32, repetition_penalty=1.3,
                                  no_repeat_ngram_size=3, return_logprobs=True)
    assert len(first.logprobs) == len(first.tokens) and all(lp <= 0 for lp in first.logprobs)


def _recorded_figures() -> set[float]:
    """Every number the JSON files under benchmarks/results/ hold, rounded to 1 and to 2 decimals."""
    import json

    found: set[float] = set()

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.update({round(float(value), 1), round(float(value), 2)})
    for path in (REPO / "benchmarks" / "results").glob("*.json"):
        walk(json.loads(path.read_text()))
    return found


def test_readme_s_measured_rates_are_each_recorded_in_a_results_file():
    """Each tokens/s and tau of README's results table, and each "N tokens/s" in its text, is a figure a
    JSON under benchmarks/results/ records (ratios are worked out from them); figures no file records
    ("226-232", "100-102", "173-174") are gone."""
    recorded = _recorded_figures()
    section = README.split("## Current results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| method")
            and "x plain" not in line and " over " not in line]
    table = [float(n) for row in rows for n in re.findall(r"(?<![\w.])(\d+\.\d+)(?![\w.x])", row)]
    text = [float(n) for n in re.findall(r"(\d+(?:\.\d+)?) tokens/s", README)]
    assert len(table) >= 12 and text
    missing = sorted({n for n in table + text if n not in recorded})
    assert not missing, f"README figures no results file records: {missing}"
    for gone in ("226-232", "100-102", "173-174"):
        assert gone not in README


def test_paths_commands_and_choices_the_docs_name_exist():
    """Each `mcsd/...` or `tools/...` file README and docs/ name is there; the hub's command line is
    `hf` (the installed hub ships it); commands run `python`, not a `.venv` the Quickstart never makes;
    docs/benchmarks.md's --bench-weights row names every weights choice the harness takes."""
    texts = {"README.md": README, **DOCS}
    missing = sorted({f"{name}: {path}" for name, text in texts.items()
                      for path in re.findall(r"(?<![\w/.])((?:mcsd|tools)/[\w/]+\.(?:py|c))", text)
                      if not (REPO / path).is_file()})
    assert not missing, missing
    for name, text in texts.items():
        commands = "\n".join(blocks("bash", text))
        assert "huggingface-cli" not in commands, name
        assert ".venv/" not in commands, name
    from mcsd.config import WEIGHTS
    row = next(line for line in DOCS["docs/benchmarks.md"].splitlines() if line.startswith("| `--bench-weights`"))
    assert all(f"`{w}`" in row for w in (*WEIGHTS, "auto")), row
