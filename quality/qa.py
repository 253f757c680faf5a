"""QA sets for `sift-eval`: questions with their gold answers and the documents to retrieve, read from a JSON
array or JSONL file (optionally gzipped) in one of four formats, and turned into engine requests.

    jsonl      one object a line: {"id", "question", "answers": [str, ...], "docs": [{"id", "text"}, ...],
               "prefix"?}; doc ids are the index's doc_ids
    hotpotqa   HotpotQA: "answer" and either "context" = [[title, [sentences]]] (the official JSON, or the hub's
               {"title": [...], "sentences": [[...]]}) or "paragraphs" = [[title, text]] (quality/data);
               doc_id = title, text = "".join(sentences) (HotpotQA sentences carry their leading spaces)
    musique    MuSiQue: "paragraphs" = [{"title", "paragraph_text"}], "answer" and "answer_aliases";
               doc_id = title
    2wiki      2WikiMultihopQA: "answer", "context" = [[title, [sentences]]], "evidences";
               doc_id = title, text = " ".join(sentences)

`--format auto` picks the format from the first row's fields. A title that occurs twice in one question with
two texts gets "#2", "#3", ... appended, in order, so every document of a question has its own doc_id.

Long documents (`long_documents`, `python -m sift.quality.qa long-docs OUT.jsonl`): HotpotQA paragraphs are
~130 tokens, too short for SIFT to skip tiles, while RAG documents are often 1-2K. The long-document set
embeds each of a question's paragraphs in a document of Wikipedia lead sections on one topic:
    - per question (official HotpotQA JSON, distractor setting): its two gold paragraphs (supporting facts) and
      its first distractor paragraph, in the question's context order;
    - per paragraph: a topic of the Wikipedia vital-article leads (wiki_vital_summaries_en.json.gz, "topic"),
      picked by a hash of the paragraph's title; that topic's leads in title order from a hashed start,
      skipping leads whose title is one of the question's titles or whose text contains the gold answer
      (so the answer comes from the HotpotQA paragraphs only), appended until the document holds
      `doc_chars` characters (5400 by default: ~1.0-1.5K SmolLM2 tokens); the paragraph is inserted between
      two leads at a hashed position. Texts are joined with blank lines;
    - doc_id "<title> (long)"; the same title always gives the same document, so questions share documents.
With doc_chars = 0 the paragraphs are kept as they are (doc_id = title): the short twin of the set, the same
questions over the same three paragraphs. Deterministic: the same inputs give the same file byte for byte.
`nq_long_documents` (`nq-long-docs`) builds the same kind of documents for NaturalQuestions-open (single-hop)
questions: the gold passage and two other questions' passages, each embedded the same way, doc_id
"<title> [<hash of the document's text>] (long)".
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import click

from sift.errors import SiftError

from ..runtime.engine import Request
from .prompts import QUERY, SYSTEM

FORMATS = ("auto", "jsonl", "hotpotqa", "musique", "2wiki")


@dataclass(frozen=True)
class QAItem:
    """One question: gold answers (any of them counts) and its documents as (doc_id, text), in prompt order.
    prefix: the text before the documents (None: the demo's chat system prompt)."""

    id: str
    question: str
    answers: tuple[str, ...]
    docs: tuple[tuple[str, str], ...]
    prefix: str | None = None

    def request(self) -> Request:
        """The prompt: prefix (default the demo's system prompt, which opens the chat's user turn), the
        documents, then the question in the demo's QUERY template (which closes the turn)."""
        prefix = SYSTEM if self.prefix is None else self.prefix
        return Request(prefix, self.docs, QUERY.format(question=self.question))


# ---------------------------------------------------------------------------------------------- readers


def _fail(row: int, problem: str, fmt: str) -> SiftError:
    return SiftError(f"QA row {row} ({fmt} format): {problem}; fix the row or pick the right --format")


def _string(value, row: int, field: str, fmt: str) -> str:
    if not isinstance(value, str):
        raise _fail(row, f"{field!r} must be a string, got {value!r:.60}", fmt)
    return value


def _unique_ids(pairs: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Titles repeated with another text inside one question become "title#2", ...; exact repeats are dropped."""
    out: dict[str, str] = {}
    for title, text in pairs:
        doc_id, k = title, 1
        while doc_id in out and out[doc_id] != text:
            k += 1
            doc_id = f"{title}#{k}"
        out.setdefault(doc_id, text)
    return tuple(out.items())


def _answers(value, row: int, fmt: str) -> tuple[str, ...]:
    golds = [value] if isinstance(value, str) else value
    if not isinstance(golds, list) or not golds or not all(isinstance(a, str) for a in golds):
        raise _fail(row, f"the gold answers must be a non-empty list of strings, got {value!r:.60}", fmt)
    return tuple(golds)


def _from_jsonl(r: dict, row: int) -> QAItem:
    docs = r.get("docs")
    if not isinstance(docs, list):
        raise _fail(row, "'docs' must be a list of {\"id\", \"text\"}", "jsonl")
    pairs = []
    for d in docs:
        if not isinstance(d, dict) or d.get("id") is None:
            raise _fail(row, f"a document must be {{\"id\", \"text\"}}, got {d!r:.60}", "jsonl")
        pairs.append((str(d.get("id")), _string(d.get("text"), row, "docs[].text", "jsonl")))
    prefix = r.get("prefix")
    return QAItem(id=str(r.get("id", row)), question=_string(r.get("question"), row, "question", "jsonl"),
                  answers=_answers(r.get("answers"), row, "jsonl"), docs=tuple(pairs),
                  prefix=None if prefix is None else _string(prefix, row, "prefix", "jsonl"))


def _context_pairs(context, row: int, fmt: str, sep: str) -> list[tuple[str, str]]:
    """HotpotQA / 2Wiki context -> [(title, text)]: [[title, [sentences]]] or {"title": [...], "sentences": [...]}."""
    if isinstance(context, dict):
        context = list(zip(context.get("title", []), context.get("sentences", [])))
    pairs = []
    for entry in context or []:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise _fail(row, f"a context entry must be [title, sentences], got {entry!r:.60}", fmt)
        title, body = entry
        pairs.append((title, body if isinstance(body, str) else sep.join(body)))
    return pairs


def _from_hotpotqa(r: dict, row: int, fmt: str = "hotpotqa", sep: str = "") -> QAItem:
    if r.get("context") is not None:
        pairs = _context_pairs(r["context"], row, fmt, sep)
    elif r.get("paragraphs") is not None:
        pairs = _context_pairs(r["paragraphs"], row, fmt, sep)
    else:
        raise _fail(row, "no 'context' (or 'paragraphs') field", fmt)
    return QAItem(id=str(r.get("_id") or r.get("id") or row), question=_string(r.get("question"), row, "question", fmt),
                  answers=_answers(r.get("answer"), row, fmt), docs=_unique_ids(pairs))


def _from_2wiki(r: dict, row: int) -> QAItem:
    return _from_hotpotqa(r, row, fmt="2wiki", sep=" ")


def _from_musique(r: dict, row: int) -> QAItem:
    paragraphs = r.get("paragraphs")
    if not isinstance(paragraphs, list) or not all(isinstance(p, dict) for p in paragraphs):
        raise _fail(row, "'paragraphs' must be a list of {\"title\", \"paragraph_text\"}", "musique")
    pairs = [(_string(p.get("title"), row, "title", "musique"),
              _string(p.get("paragraph_text"), row, "paragraph_text", "musique")) for p in paragraphs]
    aliases = r.get("answer_aliases") or []
    return QAItem(id=str(r.get("id", row)), question=_string(r.get("question"), row, "question", "musique"),
                  answers=_answers([r.get("answer"), *aliases], row, "musique"), docs=_unique_ids(pairs))


_READERS = {"jsonl": _from_jsonl, "hotpotqa": _from_hotpotqa, "musique": _from_musique, "2wiki": _from_2wiki}


def sniff_format(row: dict) -> str:
    """The format of a QA set from the fields of its first row."""
    if "docs" in row and "answers" in row:
        return "jsonl"
    paragraphs = row.get("paragraphs")
    if isinstance(paragraphs, list) and paragraphs and isinstance(paragraphs[0], dict):
        return "musique"
    if "context" in row and "evidences" in row:
        return "2wiki"
    if "context" in row or "paragraphs" in row:
        return "hotpotqa"
    raise SiftError(f"cannot tell the QA format from the fields {sorted(row)}: expected {FORMATS[1:]} "
                    f"(see `sift-eval --help`); pass --format")


def _rows(path: Path) -> list[dict]:
    """The questions of a QA file: a JSON array of objects, or one object a line (JSONL); .gz is unzipped. A
    line that is not JSON is named by its number."""
    fix = "a QA file is one JSON object a line (JSONL) or a JSON array of objects"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SiftError(f"QA file {path} cannot be read ({e}): {fix}") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise SiftError(f"QA file {path} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno}): fix it; "
                            f"{fix}") from None
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SiftError(f"QA file {path} line {number}: not valid JSON ({e.msg}, column {e.colno}): fix the "
                                f"line; {fix}") from None
    bad = next((i for i, r in enumerate(rows, 1) if not isinstance(r, dict)), None)
    if bad is not None:
        raise SiftError(f"QA file {path}: question {bad} is a JSON {type(rows[bad - 1]).__name__}, not an object; "
                        f"{fix}")
    return rows


def load_qa(path: str | Path, fmt: str = "auto", limit: int | None = None) -> tuple[list[QAItem], str]:
    """Read a QA set (.json / .jsonl, optionally .gz) -> (the first `limit` questions, the format read)."""
    if fmt not in FORMATS:
        raise SiftError(f"format {fmt!r} must be one of {', '.join(FORMATS)}")
    path = Path(path)
    if not path.is_file():
        raise SiftError(f"QA file {path} does not exist: give a .jsonl / .json file")
    rows = _rows(path)
    if not rows:
        raise SiftError(f"QA file {path} holds no questions")
    rows = rows if limit is None else rows[:limit]
    if fmt == "auto":
        fmt = sniff_format(rows[0])
    reader = _READERS[fmt]
    return [reader(r, i) for i, r in enumerate(rows, 1)], fmt


def write_qa(items: list[QAItem], path: str | Path) -> None:
    """Write questions as the QA JSONL that `load_qa` reads (format "jsonl")."""
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(dict(id=item.id, question=item.question, answers=list(item.answers),
                                    docs=[dict(id=d, text=t) for d, t in item.docs], prefix=item.prefix),
                               ensure_ascii=False) + "\n")


def write_corpus(items: list[QAItem], path: str | Path) -> list[str]:
    """Write the questions' documents as a `sift-build` corpus (one JSONL of {"id", "text"}). A doc_id that two
    questions give different texts keeps its first text (the later questions are then reported stale by the
    eval); -> those doc_ids."""
    seen: dict[str, str] = {}
    conflicts: list[str] = []
    for item in items:
        for doc_id, text in item.docs:
            if seen.setdefault(doc_id, text) != text and doc_id not in conflicts:
                conflicts.append(doc_id)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for doc_id, text in seen.items():
            f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
    return conflicts



# ------------------------------------------------------------------------------------- long documents


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _embed(title: str, paragraph: str, leads_by_topic: dict[str, list[tuple[str, str]]], excluded: set[str],
           answers: tuple[str, ...], doc_chars: int) -> str:
    """The paragraph among leads of one topic (module docstring), about doc_chars characters long; leads
    mentioning one of `answers` are skipped."""
    topics = sorted(leads_by_topic)
    leads = leads_by_topic[topics[_hash(title) % len(topics)]]
    start = _hash("start:" + title) % len(leads)
    chosen, size = [], len(paragraph)
    for k in range(len(leads)):
        lead_title, text = leads[(start + k) % len(leads)]
        if lead_title in excluded or any(a and a.lower() in text.lower() for a in answers):
            continue
        if size >= doc_chars:
            break
        chosen.append(text)
        size += len(text) + 2
    chosen.insert(_hash("at:" + title) % (len(chosen) + 1), paragraph)
    return "\n\n".join(chosen)


def _sources(read_questions, wiki: str | Path, questions_name: str):
    """(the questions `read_questions()` gives, the Wikipedia leads grouped by topic: {topic: [(title, text)]}
    in title order); a source that cannot be read is one SiftError naming both files."""
    try:
        questions = read_questions()
        with gzip.open(wiki, "rt") as f:
            leads = json.load(f)
    except (OSError, ValueError) as e:
        raise SiftError(f"cannot read the long-document sources ({e}): give {questions_name} and "
                        f"wiki_vital_summaries_en.json.gz") from None
    by_topic: dict[str, list[tuple[str, str]]] = {}
    for title in sorted(leads):
        entry = leads[title]
        by_topic.setdefault(entry.get("topic") or "Uncategorized", []).append((title, entry["extract"]))
    return questions, by_topic


def long_documents(hotpotqa: str | Path, wiki: str | Path, *, limit: int | None = None,
                   doc_chars: int = 5400) -> list[QAItem]:
    """HotpotQA questions over long documents (module docstring; doc_chars 0: the paragraphs as they are).
    hotpotqa: the official JSON (a list of questions with context and supporting_facts); wiki:
    wiki_vital_summaries_en.json.gz (title -> {extract, topic})."""
    questions, leads_by_topic = _sources(lambda: json.loads(Path(hotpotqa).read_text()), wiki, "the HotpotQA JSON")
    items = []
    for row, q in enumerate(questions[:limit], 1):
        pairs = _context_pairs(q["context"], row, "hotpotqa", "")
        gold = {title for title, _ in q["supporting_facts"]}
        distractor = next((t for t, _ in pairs if t not in gold), None)
        excluded = {t for t, _ in pairs}
        kept = [(t, text) for t, text in pairs if t in gold or t == distractor]
        if doc_chars:
            docs = [(f"{t} (long)", _embed(t, text, leads_by_topic, excluded, (q["answer"],), doc_chars))
                    for t, text in kept]
        else:
            docs = kept
        items.append(QAItem(id=str(q["_id"]), question=q["question"], answers=(q["answer"],), docs=tuple(docs)))
    return items


def nq_long_documents(nq: str | Path, wiki: str | Path, *, limit: int | None = None,
                      doc_chars: int = 5400) -> list[QAItem]:
    """NaturalQuestions-open questions over long documents (module docstring): each question's gold passage and,
    as distractors, the gold passages of the next two questions of the file (skipping any that mentions one of
    this question's answers or shares its title), each embedded among topic leads like the HotpotQA
    paragraphs; the gold document's place among the three is hashed from the question. Single-hop questions
    whose answer sits in one of three ~1.2K-token documents. nq: nq-open-oracle.jsonl.gz (question, answers,
    ctxs = [the gold passage {title, text}])."""
    def read_nq():
        with gzip.open(nq, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]

    rows, leads_by_topic = _sources(read_nq, wiki, "nq-open-oracle.jsonl.gz")
    for row, r in enumerate(rows, 1):
        ctxs = r.get("ctxs") if isinstance(r, dict) else None
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(ctxs, list) and ctxs
                and isinstance(ctxs[0], dict) and all(isinstance(ctxs[0].get(k), str) for k in ("title", "text"))):
            raise SiftError(f"{nq} row {row}: each row needs a 'question' string and 'ctxs' = [{{'title', 'text'}}, "
                            f"...] with the gold passage first; give the NaturalQuestions-open oracle file")

    def passage(r: dict) -> tuple[str, str]:
        return r["ctxs"][0]["title"], r["ctxs"][0]["text"]

    items = []
    for row, r in enumerate(rows[:limit], 1):
        answers = tuple(_answers(r.get("answers"), row, "nq"))
        gold = passage(r)
        distractors = []
        for k in range(1, len(rows)):
            title, text = passage(rows[(row - 1 + k) % len(rows)])
            if title != gold[0] and title not in {t for t, _ in distractors} and \
                    not any(a.lower() in text.lower() for a in answers):
                distractors.append((title, text))
            if len(distractors) == 2:
                break
        kept = list(distractors)
        kept.insert(_hash("gold:" + r["question"]) % 3, gold)
        excluded = {t for t, _ in kept}
        texts = [_embed(t, text, leads_by_topic, excluded, answers, doc_chars) if doc_chars else text
                 for t, text in kept]
        # One title has several NQ passages, and a passage's leads depend on the question's answers: the doc_id
        # names the document's text, not only the title
        docs = [(f"{t} [{_hash(text) % 16 ** 8:08x}]" + (" (long)" if doc_chars else ""), text)
                for (t, _), text in zip(kept, texts)]
        items.append(QAItem(id=f"nq-{row}", question=r["question"], answers=answers, docs=tuple(docs)))
    return items


def write_jsonl(items: list[QAItem], path: str | Path) -> None:
    """Write questions as the eval's JSONL ({"id", "question", "answers", "docs": [{"id", "text"}], "prefix"?})."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for item in items:
            row = dict(id=item.id, question=item.question, answers=list(item.answers),
                       docs=[dict(id=d, text=t) for d, t in item.docs])
            if item.prefix is not None:
                row["prefix"] = item.prefix
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


@click.group()
def main():
    """QA-set tools."""


def _long_doc_command(name: str, source: str, default: str, source_help: str):
    """A long-document command: `name OUT` with its question source option (`source`, default path, help) and
    the options both commands take (wiki, limit, doc-chars)."""
    options = (
        main.command(name),
        click.argument("out", type=click.Path(path_type=Path)),
        click.option(source, type=click.Path(path_type=Path), default=Path(default), show_default=True,
                     help=source_help),
        click.option("--wiki", type=click.Path(path_type=Path),
                     default=Path("../shared/data/wiki_vital_summaries_en.json.gz"), show_default=True,
                     help="Wikipedia vital-article leads (title -> {extract, topic})."),
        click.option("--limit", type=click.IntRange(1), default=None, help="The first N questions only."),
        click.option("--doc-chars", type=click.IntRange(0), default=5400, show_default=True,
                     help="Characters per long document (~4 per SmolLM2 token); 0: the paragraphs as they are."))

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def _write_set(build, out: Path) -> None:
    try:
        items = build()
    except SiftError as e:
        raise click.ClickException(str(e)) from None
    write_jsonl(items, out)
    click.echo(f"{len(items)} questions, {sum(len(i.docs) for i in items)} documents -> {out}")


@_long_doc_command("long-docs", "--hotpotqa", "../shared/data/hotpotqa_train.json",
                   "Official HotpotQA JSON (distractor setting).")
def long_docs(out, hotpotqa, wiki, limit, doc_chars):
    """Write HotpotQA questions over ~1-2K-token documents (gold paragraphs inside topic-grouped Wikipedia
    leads) as the eval's JSONL."""
    _write_set(lambda: long_documents(hotpotqa, wiki, limit=limit, doc_chars=doc_chars), out)


@_long_doc_command("nq-long-docs", "--nq", "../shared/data/nq-open-oracle.jsonl.gz",
                   "NaturalQuestions-open with each question's gold passage (ctxs).")
def nq_long_docs(out, nq, wiki, limit, doc_chars):
    """Write NaturalQuestions-open questions over three ~1-2K-token documents (the gold passage and two other
    questions' passages inside topic-grouped Wikipedia leads) as the eval's JSONL."""
    _write_set(lambda: nq_long_documents(nq, wiki, limit=limit, doc_chars=doc_chars), out)


if __name__ == "__main__":
    main()
