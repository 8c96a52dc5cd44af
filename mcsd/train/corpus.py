"""Text for teacher-forced passes: files the user names, or the source and
documentation of installed Python packages, cut into token chunks with
provenance.

A draft head learns what the target predicts at a position from the target's
own features there, and a teacher-forced pass produces those (features and
top-k labels) for any text at ~10x the rate of generating it. This module
finds the text; `target_data.py corpus` stores it as a run and `teacher`
labels it.

Each document is one file. Its provenance (package name and version, the
licence its metadata declares, or the path and a licence the user states)
travels with every chunk and is summed per source in the run's manifest
entry, so a head's card can say what it was trained on. Evaluation data is
refused: any file under the Spec-Bench data folder or named like its
question file.

Chunks end at line boundaries, at most `chunk_tokens` tokens (a longer line
is cut). In "chat" format each chunk becomes an assistant turn answering a
request built from the file's kind and name ("Show me the Python module
`json.decoder`..."), so the positions are read in the chat context the
target generates in; "plain" keeps the text bare.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
KIND = {".py": "Python module", ".md": "document", ".rst": "document", ".txt": "text"}
MAX_FILE_BYTES = 2_000_000           # larger files are data, not prose or code


class CorpusError(ValueError):
    """A corpus source that cannot be used (missing, not installed, an evaluation set)."""


@dataclass
class Document:
    key: str                          # stable id: "<source>:<relative path>"
    source: str                       # package name or the path given
    name: str                         # what the chat request calls it (module path, file name)
    kind: str                         # "Python module", "document", "text"
    text: str
    licence: str


def _licence(meta) -> str:
    """The licence a distribution's metadata declares (SPDX expression, licence field or classifier)."""
    for field_name in ("License-Expression", "License"):
        value = (meta.get(field_name) or "").strip()
        if value and value.upper() != "UNKNOWN" and len(value) <= 80:
            return value
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(classifiers) if classifiers else "unknown"


def package_documents(name: str, suffixes=TEXT_SUFFIXES) -> tuple[list[Document], str]:
    """Text files an installed distribution ships, and its version. Its metadata's long description
    (usually the README) is one more document."""
    from importlib import metadata

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise CorpusError(f"package {name!r} is not installed in this environment") from None
    meta = dist.metadata
    lic = _licence(meta)
    docs = []
    description = meta.get_payload() if hasattr(meta, "get_payload") else None
    if isinstance(description, str) and description.strip():
        docs.append(Document(f"{name}:METADATA", name, f"{name} package description", "document", description, lic))
    for f in sorted(dist.files or [], key=str):
        path = Path(str(dist.locate_file(f)))
        if path.suffix not in suffixes or "__pycache__" in f.parts or not path.is_file():
            continue
        label = ".".join(f.with_suffix("").parts).removesuffix(".__init__") if f.suffix == ".py" else str(f)
        docs += _document(path, name, str(f), label, lic)
    return docs, dist.version


def path_documents(root: str | Path, licence: str = "unknown", suffixes=TEXT_SUFFIXES) -> list[Document]:
    """Text files under a directory (or one file), sorted by path."""
    root = Path(root)
    if not root.exists():
        raise CorpusError(f"corpus path {root} does not exist")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)
    docs = []
    for path in files:
        rel = path.name if root.is_file() else str(path.relative_to(root))
        docs += _document(path, str(root), rel, rel, licence)
    return docs


def _document(path: Path, source: str, rel: str, label: str, licence: str) -> list[Document]:
    """The file as a document of `source` (none when it is too large to be prose or code)."""
    if path.stat().st_size > MAX_FILE_BYTES:
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    return [Document(f"{source}:{rel}", source, label, KIND.get(path.suffix, "text"), text, licence)]


def refuse_evaluation_data(paths: list[str | Path], evaluation_files: list[str | Path]) -> None:
    """Refuse a corpus path that is, or holds, an evaluation set's file (or sits in its folder)."""
    guarded = [Path(e).resolve() for e in evaluation_files if e]
    for p in paths:
        p = Path(p).resolve()
        for ev in guarded:
            if p.is_relative_to(ev.parent) or ev.is_relative_to(p):    # in its folder, or holding it
                raise CorpusError(f"{p} holds evaluation data ({ev}); corpora must not contain it")


def dedupe(docs: list[Document]) -> list[Document]:
    """Drop documents whose text another document already has (vendored copies, empty __init__.py)."""
    seen, out = set(), []
    for d in docs:
        digest = hashlib.sha256(d.text.encode()).digest()
        if d.text.strip() and digest not in seen:
            seen.add(digest)
            out.append(d)
    return out


def chat_request(doc: Document) -> str:
    if doc.kind == "Python module":
        return f"Show me the source code of the Python module `{doc.name}` from {doc.source}."
    return f"Show me the {doc.kind} `{doc.name}` from {doc.source}."


def chunk_lines(text: str, encode, chunk_tokens: int) -> list[list[int]]:
    """Token chunks of `text`, each at most `chunk_tokens`, cut at line ends where possible."""
    chunks, cur = [], []
    for line in text.splitlines(keepends=True):
        ids = encode(line)
        while len(ids) > chunk_tokens:                 # a very long line: cut it
            if cur:
                chunks.append(cur)
                cur = []
            chunks.append(ids[:chunk_tokens])
            ids = ids[chunk_tokens:]
        if len(cur) + len(ids) > chunk_tokens:
            chunks.append(cur)
            cur = []
        cur = cur + ids
    if cur:
        chunks.append(cur)
    return [c for c in chunks if len(c) >= 8]        # fragments too short to teach anything


def records(doc: Document, tokenizer, chunk_tokens: int, fmt: str = "chat") -> list[dict]:
    """One record per chunk: {"key", "prompt_id", "category", "prompt", "response", "finished"}.

    chat: prompt = the chat template up to the assistant turn for `chat_request(doc)`,
    response = the chunk. plain: prompt = the chunk's first token, response = the rest.
    Token ids are int32 tensors, as the other stages store them.
    """
    import torch

    if fmt not in ("chat", "plain"):
        raise CorpusError(f"corpus format must be 'chat' or 'plain', not {fmt!r}")
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    prefix = None
    if fmt == "chat":
        from mcsd.loading.data import chat_ids
        if not getattr(tokenizer, "chat_template", None):
            raise CorpusError("this tokenizer has no chat template: use the plain format")
        prefix = chat_ids(tokenizer, chat_request(doc))
    out = []
    for i, chunk in enumerate(chunk_lines(doc.text, encode, chunk_tokens)):
        prompt, response = (prefix, chunk) if prefix is not None else (chunk[:1], chunk[1:])
        out.append({"key": f"{doc.key}#{i}", "prompt_id": doc.key, "category": f"corpus-{doc.kind}",
                    "prompt": torch.tensor(prompt, dtype=torch.int32),
                    "response": torch.tensor(response, dtype=torch.int32), "finished": False})
    return out


def main(argv=None) -> int:
    """A library with no stage of its own: `--help` (or no argument) prints what it is and what runs it."""
    from mcsd.train import library_main
    return library_main(__doc__, "`python tools/target_data.py corpus` runs it; `teacher` labels what it stores.",
                        argv)
