"""`sift-calibrate`: choose the profile thresholds for a model and a corpus from answers, not from the paper.

    sift-calibrate QA_FILE --out DIR [--held-in N] [--limit N] [--target-agreement 0.95] [--sweep-only]
                   [--reuse-sweep] [--setting "tile=16,alpha=0.001,beta=0.01,gamma=0.1" ...] [--model M]
                   [--max-new-tokens T] [--device D] [--dtype T] [--block B] [--no-floor]
                   [--held-out-front | --held-out-all] [--guard-ca EPS ... [--guard-by layer|head ...]
                   [--guard-prompts N] [--guard-at-block]]

1. The first --held-in questions of QA_FILE are held in, the rest (up to --limit) held out.
2. Sweep: for every setting (tile, alpha, beta, gamma, LA criterion and coverage, or the reader criterion and its
   coverage; `DEFAULT_GRID` unless --setting is given, e.g. --setting "tile=16,criterion=reader,coverage=0.997"), build an index of the held-in questions' documents with `sift-build --config` (a
   generated TOML, as an operator would: serving code never imports the builder) and run the held-in questions
   densely and with SIFT: whole-answer and first-token agreement with dense, and the tiles computed.
   With --guard-ca, each setting's guarded twins are swept too (`guard`: CA pages kept whole in the layers,
   or with --guard-by head the (layer, head) pairs, whose document rows lose more than EPS of their attention
   mass on dropped CA pages, measured in context on the first --guard-prompts held-in prompts; with
   --guard-at-block, counting the pages as the engine's kernel block computes them).
3. The Pareto front of agreement against tiles computed -> DIR/front.json and DIR/front.png.
4. Unless --sweep-only: the sparsest setting whose held-in agreement meets --target-agreement is chosen and
   written as DIR/calibrated.toml (`sift-build --config DIR/calibrated.toml` takes it); it and the paper's
   defaults (`DEFAULT`) are then built over the held-out questions' documents and evaluated on them with
   `sift-eval`'s full report -> DIR/held_out/<setting>/report.{json,md}, summarised in front.json.
   --reuse-sweep takes the points of an earlier run's front.json instead of sweeping again (to choose for
   another target without rebuilding). --held-out-front evaluates the defaults and every setting of the
   held-in front there, also when no setting meets the target; --held-out-all every swept setting.
5. The floor (unless --no-floor): how often dense agrees with dense. The engine's dense answers against greedy
   answers of the same weights through transformers' own attention, at the serving dtype and at the other of
   float32 / bfloat16, on the held-in and the held-out questions (front.json `floor`, `held_out_floor`; lines
   on front.png). Whole 24-token answers of a small model flip on rounding alone; a target above the floor
   asks sparsity to agree with dense more often than dense agrees with itself.

Settings are compared on the same questions, the same model and the same greedy decoding; tile fraction is the
engine's (head, query block, key block) triples computed over dense, at the kernel block (--block; default 128
on CUDA, the index tile on CPU: --block 128 on CPU computes the GPU's blocks).
Exit codes: 0 done (also when no setting met the target: then no TOML is written and front.json says so),
2 bad usage or input (one line on stderr).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from sift.errors import SiftError
from sift.format import TILES
from sift.model import DTYPES, resolve_dtype
from sift.plots import pareto_front

from .eval import REFERENCE, aggregate, check_output_dir, evaluate, skip_reason, write_report
from .qa import FORMATS, QAItem, load_qa, write_corpus, write_qa

EXIT_OK, EXIT_ERROR = 0, 2
CRITERIA = ("threshold", "mass")          # la_criterion of the threshold criterion
PROFILE_CRITERIA = ("threshold", "reader")  # [profile] criterion


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: the [profile] keys that decide the bits."""

    tile: int = 64
    alpha: float = 0.001
    beta: float = 0.01
    gamma: float = 0.1
    la_criterion: str = "threshold"
    la_coverage: float = 0.95
    criterion: str = "threshold"  # "reader": LA and CA chosen on [prefix, document, reader] at `coverage`
    coverage: float = 0.997
    ca_full_layers: tuple[int, ...] = ()  # layers whose CA pages are all kept (a guarded setting, `guard`)
    ca_full_heads: tuple[tuple[int, int], ...] = ()  # (layer, head) pairs whose CA pages are all kept

    def __post_init__(self):
        """Refuse a setting `sift-build` would refuse, before anything is built for it."""
        if self.tile not in TILES:
            raise SiftError(f"tile = {self.tile} is not one of {', '.join(map(str, TILES))}")
        for name in ("alpha", "beta", "gamma"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SiftError(f"{name} = {getattr(self, name)!r} must be in [0, 1]")
        if self.la_criterion not in CRITERIA:
            raise SiftError(f"criterion = {self.la_criterion!r} must be one of {', '.join(CRITERIA + ('reader',))}")
        if not 0.0 < self.la_coverage <= 1.0:
            raise SiftError(f"coverage = {self.la_coverage!r} must be in (0, 1]")
        if self.criterion not in PROFILE_CRITERIA:
            raise SiftError(f"criterion = {self.criterion!r} must be one of {', '.join(PROFILE_CRITERIA)}")
        if not 0.0 < self.coverage <= 1.0:
            raise SiftError(f"coverage = {self.coverage!r} must be in (0, 1]")
        if self.criterion == "reader" and self.la_criterion != "threshold":
            raise SiftError("the reader criterion chooses LA tiles itself: it takes no la_criterion")
        object.__setattr__(self, "ca_full_layers", tuple(sorted({int(layer) for layer in self.ca_full_layers})))
        object.__setattr__(self, "ca_full_heads", tuple(sorted({(int(l), int(h)) for l, h in self.ca_full_heads})))
        if any(layer < 0 for layer in self.ca_full_layers) or any(min(pair) < 0 for pair in self.ca_full_heads):
            raise SiftError(f"ca_full / ca_heads name layers and heads by index >= 0, got {self.ca_full_layers} "
                            f"{self.ca_full_heads}")

    @property
    def guarded(self) -> bool:
        return bool(self.ca_full_layers or self.ca_full_heads)

    @property
    def label(self) -> str:
        la = f"a{self.alpha:g}" if self.la_criterion == "threshold" else f"mass{self.la_coverage:g}"
        guarded = f"-ca{_ranges(self.ca_full_layers)}" if self.ca_full_layers else ""
        if self.ca_full_heads:  # too many pairs for a folder name: their count and a digest
            digest = hashlib.sha256(json.dumps(self.ca_full_heads).encode()).hexdigest()[:8]
            guarded += f"-cah{len(self.ca_full_heads)}.{digest}"
        if self.criterion == "reader":
            return f"t{self.tile}-reader{self.coverage:g}{guarded}"
        return f"t{self.tile}-{la}-b{self.beta:g}-g{self.gamma:g}{guarded}"

    def toml(self, model: str) -> str:
        """A complete `sift-build --config` file: this setting, the other keys at their defaults."""
        return (f'model = "{model}"\n\n[profile]\ntile = {self.tile}\nalpha = {self.alpha!r}\nbeta = {self.beta!r}\n'
                f'gamma = {self.gamma!r}\nla_criterion = "{self.la_criterion}"\nla_coverage = {self.la_coverage!r}\n'
                f'criterion = "{self.criterion}"\ncoverage = {self.coverage!r}\n'
                f'ca_full_layers = {list(self.ca_full_layers)}\n'
                f'ca_full_heads = {[list(pair) for pair in self.ca_full_heads]}\n')


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 7, 8) -> "0-2.5.7-8" (sorted layers, for labels and folder names)."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ".".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


DEFAULT = Setting()  # the paper's thresholds at the default tile (configs/default.toml)
# Around the paper's point: finer tiles, looser and tighter thresholds, and the mass criterion.
DEFAULT_GRID = (
    DEFAULT,
    Setting(tile=32),
    Setting(tile=16),
    Setting(tile=16, alpha=0.0001, beta=0.005, gamma=0.05),
    Setting(tile=32, alpha=0.0003, beta=0.005, gamma=0.05),
    Setting(tile=16, la_criterion="mass", la_coverage=0.99, beta=0.005, gamma=0.05),
    Setting(tile=32, la_criterion="mass", la_coverage=0.99, beta=0.005, gamma=0.05),
)


def parse_setting(text: str) -> Setting:
    """"tile=16,alpha=0.001,beta=0.01,gamma=0.1,criterion=mass,coverage=0.99,ca_full=14/17,ca_heads=0.3/5.1"
    -> Setting (unset keys: defaults; criterion: mass (la_criterion, coverage its la_coverage) or reader (the
    reader criterion, coverage its share of the mass kept); ca_full: the layers whose CA pages are all kept,
    separated by "/"; ca_heads: the same for (layer, head) pairs written layer.head)."""
    values: dict = {}
    names = {"criterion": "la_criterion", "coverage": "la_coverage", "ca_full": "ca_full_layers",
             "ca_heads": "ca_full_heads"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key = names.get(key.strip(), key.strip())
        if key not in Setting.__dataclass_fields__ or not value:
            raise SiftError(f"--setting {text!r}: {part!r} is not key=value with key one of tile, alpha, beta, "
                            f"gamma, criterion, coverage, ca_full, ca_heads")
        try:
            if key == "ca_full_layers":
                values[key] = tuple(int(layer) for layer in value.split("/"))
            elif key == "ca_full_heads":
                values[key] = tuple(_pair(pair) for pair in value.split("/"))
            else:
                values[key] = (value.strip() if key == "la_criterion"
                               else int(value) if key == "tile" else float(value))
        except ValueError:
            kind = {"ca_full_layers": "layers separated by /",
                    "ca_full_heads": "layer.head pairs separated by /"}.get(key, "a number")
            raise SiftError(f"--setting {text!r}: {key} = {value!r} is not {kind}") from None
    if values.get("la_criterion") == "reader":  # the reader criterion is [profile] criterion, with its own coverage
        values["criterion"] = values.pop("la_criterion")
        if "la_coverage" in values:
            values["coverage"] = values.pop("la_coverage")
    try:
        return Setting(**values)
    except SiftError as e:
        raise SiftError(f"--setting {text!r}: {e}") from None


def _pair(text: str) -> tuple[int, int]:
    layer, dot, head = text.partition(".")
    if not dot:
        raise ValueError(text)
    return int(layer), int(head)


# --------------------------------------------------------------------------------------- the pure part


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row dominates (at most as many tiles and at least the agreement, one of them strictly
    better), in increasing tile fraction. rows: {"tile_fraction", "agreement", ...}."""
    def dominated(r):
        return any(o["tile_fraction"] <= r["tile_fraction"] and o["agreement"] >= r["agreement"]
                   and (o["tile_fraction"] < r["tile_fraction"] or o["agreement"] > r["agreement"]) for o in rows)
    return sorted((r for r in rows if not dominated(r)), key=lambda r: r["tile_fraction"])


def held_out_settings(rows: list[dict], front: list[dict], every: bool = False) -> list["Setting"]:
    """What `--held-out-front` evaluates on the held-out questions: the paper's defaults, then the settings of
    the held-in front (every: of all swept rows, dominated or not), in their order, without repeats."""
    return list(dict.fromkeys([DEFAULT, *(Setting(**r["setting"]) for r in (rows if every else front))]))


def choose(rows: list[dict], target: float) -> dict | None:
    """The sparsest row whose agreement meets the target (ties: the higher agreement, then the label); None when
    no row does."""
    meeting = [r for r in rows if r["agreement"] >= target]
    if not meeting:
        return None
    return min(meeting, key=lambda r: (r["tile_fraction"], -r["agreement"], r["label"]))


def within_tiles(rows: list[dict], reference: str) -> dict | None:
    """The row, other than `reference`'s (a label), with the best agreement (then first token, then fewer tiles,
    then the label) among those computing at most the tiles `reference` computes; None when none does or the
    reference is not among the rows."""
    ref = next((r for r in rows if r["label"] == reference), None)
    fits = [r for r in rows if ref is not None and r["label"] != reference
            and r["tile_fraction"] <= ref["tile_fraction"]]
    return max(fits, key=lambda r: (r["agreement"], r["agreement_first_token"], -r["tile_fraction"], r["label"]),
               default=None)


# --------------------------------------------------------------------------------------------- running


class _Runner:
    """The model once; one engine per index; dense answers once per (question, block). batch: questions per
    engine call (prefilled together and decoded in one continuous batch; a question's tile fraction is then its
    batch's); kv_bytes: each engine's KV pool (None: the engine's default share of the free GPU memory, which
    processes sharing one GPU would each claim)."""

    def __init__(self, model: str, device: str, max_new_tokens: int, echo, dtype: str = "auto",
                 block: int | None = None, batch: int = 1, kv_bytes: int | None = None):
        from sift.model import load_model

        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise SiftError(f"batch={batch!r} must be an integer >= 1")
        self.device, self.model_name, self.block, self.batch, self.kv_bytes = device, model, block, batch, kv_bytes
        self.dtype = resolve_dtype(dtype, device)
        self.hf, self.tokenizer, _ = load_model(model, dtype=self.dtype, device=device)
        self.max_new_tokens, self.echo = max_new_tokens, echo
        self._dense: dict[tuple[str, int], list[int]] = {}
        self._twins: dict[str, object] = {}

    def engine(self, index_path: Path):
        from ..runtime.engine import SiftEngine
        from ..runtime.store import SiftIndex

        return SiftEngine(self.hf, self.tokenizer, SiftIndex.open(index_path, device=self.device), block=self.block,
                          kv_cache_bytes=self.kv_bytes)

    def dense(self, engine, items: list[QAItem]) -> list[list[int]]:
        """Dense answers of `items`, those not known yet generated `batch` per engine call."""
        missing = [item for item in items if (item.id, engine.block) not in self._dense]
        for start in range(0, len(missing), self.batch):
            chunk = missing[start:start + self.batch]
            out = engine.generate([item.request() for item in chunk], self.max_new_tokens, mode=REFERENCE)
            for item, ids in zip(chunk, out.token_ids):
                self._dense[(item.id, engine.block)] = ids
        return [self._dense[(item.id, engine.block)] for item in items]

    def agreement(self, index_path: Path, items: list[QAItem]) -> dict:
        """Held-in questions over one index -> {"agreement", "agreement_first_token", "tile_fraction", "n",
        "skipped"}; questions the index cannot serve (a document missing or stale) are skipped."""
        engine = self.engine(index_path)
        runnable = [item for item in items if skip_reason(engine, item) is None]
        if not runnable:
            raise SiftError(f"the index {index_path} serves none of the held-in questions: see `sift-inspect`")
        same, first, tiles = [], [], []
        for start in range(0, len(runnable), self.batch):
            chunk = runnable[start:start + self.batch]
            sift = engine.generate([item.request() for item in chunk], self.max_new_tokens, mode="sift")
            for ids, dense in zip(sift.token_ids, self.dense(engine, chunk)):
                same.append(float(ids == dense))
                first.append(float(ids[:1] == dense[:1]))
                tiles.append(sift.prefill.tile_fraction)
        n = len(runnable)
        return dict(n=n, skipped=len(items) - n, agreement=sum(same) / n, agreement_first_token=sum(first) / n,
                    tile_fraction=sum(tiles) / n)

    def _twin(self, dtype: str):
        """The same weights in `dtype` behind transformers' own attention (the floor's other dense)."""
        if dtype not in self._twins:
            from sift.model import load_model

            self._twins[dtype] = load_model(self.model_name, dtype=dtype, device=self.device)[0]
        return self._twins[dtype]

    def floor(self, index_path: Path, items: list[QAItem], dtypes=None) -> dict:
        """How often dense agrees with dense: the engine's dense answers against greedy answers of the same
        model through transformers' own attention (SDPA), at the serving dtype and at each other dtype.
        Sparsity cannot be asked to agree with dense more often than two dense computations agree with each
        other. -> {dtype: {"n", "agreement", "agreement_first_token"}}."""
        engine = self.engine(index_path)
        runnable = [item for item in items if skip_reason(engine, item) is None]
        dtypes = dtypes or [self.dtype, *(d for d in ("float32", "bfloat16") if d != self.dtype)]
        out = {}
        for dtype in dtypes:
            twin = self._twin(dtype)
            same, first = [], []
            for item, dense in zip(runnable, self.dense(engine, runnable)):
                other = greedy(twin, engine.prompt_ids(item.request()), self.max_new_tokens, engine.eos_ids)
                same.append(float(other == dense))
                first.append(float(other[:1] == dense[:1]))
            n = max(1, len(runnable))
            out[dtype] = dict(n=len(runnable), agreement=sum(same) / n, agreement_first_token=sum(first) / n)
        return out


@torch.inference_mode()
def greedy(model, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """Greedy tokens of a plain transformers forward with its own KV cache, up to and including the first eos
    (the engine's convention)."""
    ids = torch.tensor([prompt], device=model.device)
    out, past = [], None
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        token = int(res.logits[0, -1].float().argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids = torch.tensor([[token]], device=model.device)
    return out


def sift_build(setting: Setting, corpus: Path, index: Path, model: str) -> None:
    """`sift-build CORPUS --out INDEX --config INDEX.toml` (incremental when the index exists). The default
    builder of the sweep; `calibrate_items(build=...)` takes any callable of this signature."""
    index.parent.mkdir(parents=True, exist_ok=True)
    config = index.parent / f"{index.name}.toml"
    config.write_text(setting.toml(model))
    cmd = [str(Path(sys.executable).with_name("sift-build")), str(corpus), "--out", str(index), "--config", str(config)]
    if not Path(cmd[0]).exists():
        raise SiftError(f"{cmd[0]} not found: install the package (`make install`) to build indexes")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode not in (0, 1):  # 1: some documents are error rows; the eval reports them as skipped
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        raise SiftError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}: {tail}")


def sweep(runner: _Runner, settings, items: list[QAItem], out: Path, model: str, echo, build=sift_build) -> list[dict]:
    """Build and measure every setting on the held-in questions -> one row per setting."""
    corpus = out / "corpus" / "held_in"
    conflicts = write_corpus(items, corpus / "docs.jsonl")
    if conflicts:
        echo(f"held-in documents with two texts (the later questions are skipped as stale): {conflicts[:5]}")
    rows = []
    for k, setting in enumerate(settings, 1):
        echo(f"[{k}/{len(settings)}] {setting.label}: building")
        index = out / "indexes" / setting.label
        build(setting, corpus, index, model)
        row = dict(label=setting.label, criterion=setting.la_criterion, setting=asdict(setting),
                   index=str(index), **runner.agreement(index, items))
        echo(f"[{k}/{len(settings)}] {setting.label}: agreement {row['agreement']:.0%}, first token "
             f"{row['agreement_first_token']:.0%}, tiles computed {row['tile_fraction']:.1%}")
        rows.append(row)
    return rows


def held_out(runner: _Runner, settings, items: list[QAItem], out: Path, model: str, echo,
             build=sift_build, done=lambda results: None) -> dict:
    """The chosen and the default settings over the held-out questions: sift-eval's report for each. done: called
    with the results so far after each setting."""
    corpus = out / "corpus" / "held_out"
    write_corpus(items, corpus / "docs.jsonl")
    results = {}
    for setting in dict.fromkeys(settings):
        folder = out / "held_out" / setting.label
        echo(f"held out: {setting.label}: building")
        build(setting, corpus, folder / "index", model)
        engine = runner.engine(folder / "index")
        rows, skipped = evaluate(engine, items, [REFERENCE, "sift"], batch=runner.batch,
                                 max_new_tokens=runner.max_new_tokens)
        modes = aggregate(rows, [REFERENCE, "sift"])
        report = dict(settings=dict(index=str(folder / "index"), qa_file=str(out / "held_out.jsonl"), format="jsonl",
                                    model=model, dtype=runner.dtype, backend=engine.backend, block=engine.block,
                                    tile=setting.tile, modes=[REFERENCE, "sift"], max_new_tokens=runner.max_new_tokens,
                                    batch=runner.batch, limit=None),
                      questions=len(items), evaluated=len(rows), modes=modes, rows=rows, skipped=skipped)
        write_report(report, folder)
        sift = modes["sift"]
        results[setting.label] = dict(setting=asdict(setting), n=len(rows), report=str(folder / "report.json"),
                                      **{k: sift[k]["mean"] for k in ("agreement_answer", "agreement_first_token",
                                                                      "tile_fraction", "em", "f1", "containment")},
                                      agreement_answer_ci95=sift["agreement_answer"]["ci95"],
                                      dense_em=modes[REFERENCE]["em"]["mean"],
                                      dense_containment=modes[REFERENCE]["containment"]["mean"])
        echo(f"held out: {setting.label}: agreement {results[setting.label]['agreement_answer']:.0%}, tiles "
             f"computed {results[setting.label]['tile_fraction']:.1%} ({len(rows)} questions)")
        done(dict(results))
    return results


def guard_layers(ca_mass_lost: list, eps: float) -> tuple[int, ...]:
    """The layers whose document rows put more than `eps` of their attention mass on CA pages the bits drop (the
    per-layer `ca_mass_lost` of `quality.recall`); a layer without cross-document cells (None) never does."""
    return tuple(i for i, lost in enumerate(ca_mass_lost) if lost is not None and lost > eps)


def guard_heads(heads_ca_mass_lost: list, eps: float) -> tuple[tuple[int, int], ...]:
    """The (layer, head) pairs whose document rows put more than `eps` of their attention mass on dropped CA
    pages (`quality.recall`'s `heads_ca_mass_lost`, [layer][head]; None: no cross-document cells)."""
    return tuple((layer, head) for layer, row in enumerate(heads_ca_mass_lost) for head, lost in enumerate(row)
                 if lost is not None and lost > eps)


GUARD_BY = ("layer", "head")


def guard(runner: _Runner, rows: list[dict], items: list[QAItem], eps_list, prompts: int, echo,
          by=("layer",), at_block: bool = False) -> tuple[list, dict]:
    """The guarded twins of swept settings. One set of thresholds does not suit every layer: the bits come from
    each document alone, and in some layers later documents read pages the document's own rows never
    concentrate on. For each swept setting (not itself guarded) the model runs the first `prompts` held-in
    prompts with exact attention against the setting's bits (`quality.recall`; at_block: as the engine's kernel
    block computes them, where a page the bits drop inside a computed block is not lost), and for each eps the
    layers (by "layer": `ca_full_layers`) or the (layer, head) pairs (by "head": `ca_full_heads`, finer: a
    layer's other heads keep their bits) whose document rows lose more than eps of their attention mass on
    dropped CA pages keep all their CA pages. -> (the new settings, {label: {"prompts", "block", "ca_mass_lost",
    "ca_recall", "heads_ca_mass_lost", "guards": {eps: layers}, "guards_heads": {eps: pairs}}})."""
    from .recall import measure

    unknown = set(by) - set(GUARD_BY)
    if unknown:
        raise SiftError(f"guard by {sorted(unknown)}: choose among {', '.join(GUARD_BY)}")
    twins, info, seen = [], {}, {r["label"] for r in rows}
    for row in rows:
        setting = Setting(**row["setting"])
        if setting.guarded:
            continue
        engine = runner.engine(Path(row["index"]))
        runnable = [item for item in items if skip_reason(engine, item) is None][:prompts]
        summary = measure(engine, [item.request() for item in runnable], block=engine.block if at_block else None)
        lost = [layer["ca_mass_lost"] for layer in summary["layers"]]
        entry = info[row["label"]] = dict(prompts=len(runnable), block=summary["block"], ca_mass_lost=lost,
                                          ca_recall=[layer["ca_recall"] for layer in summary["layers"]],
                                          heads_ca_mass_lost=summary["heads_ca_mass_lost"])
        candidates = []
        if "layer" in by:
            entry["guards"] = {f"{eps:g}": guard_layers(lost, eps) for eps in eps_list}
            echo(f"guard: {row['label']}: " + ", ".join(f"layers losing > {eps} of their mass on dropped CA pages: "
                                                         f"{list(layers) or 'none'}"
                                                         for eps, layers in entry["guards"].items()))
            candidates += [dict(ca_full_layers=layers) for layers in entry["guards"].values() if layers]
        if "head" in by:
            entry["guards_heads"] = {f"{eps:g}": guard_heads(summary["heads_ca_mass_lost"], eps) for eps in eps_list}
            echo(f"guard: {row['label']}: " + ", ".join(f"(layer, head) pairs losing > {eps}: {len(pairs)} in layers "
                                                         f"{sorted({l for l, _ in pairs}) or 'none'}"
                                                         for eps, pairs in entry["guards_heads"].items()))
            candidates += [dict(ca_full_heads=pairs) for pairs in entry["guards_heads"].values() if pairs]
        for change in candidates:
            twin = Setting(**{**asdict(setting), **change})
            if twin.label not in seen:
                seen.add(twin.label)
                twins.append(twin)
    return twins, info


def _previous_sweep(out: Path, qa_file: Path, held_in: int, model: str, max_new_tokens: int) -> list[dict]:
    """The points of DIR/front.json, checked to come from the same questions, model and decoding."""
    try:
        previous = json.loads((out / "front.json").read_text())
    except (OSError, ValueError) as e:
        raise SiftError(f"--reuse-sweep: cannot read {out / 'front.json'} ({e}): run the sweep first") from None
    same = (previous.get("qa_file"), previous.get("held_in"), previous.get("model"), previous.get("max_new_tokens"))
    if same != (str(qa_file), held_in, model, max_new_tokens):
        raise SiftError(f"--reuse-sweep: {out / 'front.json'} was swept with (QA file, held-in, model, max new "
                        f"tokens) = {same}, not {(str(qa_file), held_in, model, max_new_tokens)}: rerun the sweep")
    return previous["points"]


def calibrate(qa_file: Path, out: Path, *, settings, held_in: int, limit: int | None, target: float | None,
              model: str, fmt: str = "auto", device: str = "auto", dtype: str = "auto", max_new_tokens: int = 24,
              reuse_sweep=False, floor=True, held_out_front=False, held_out_all=False, guard_ca=(), guard_prompts=5,
              guard_by=("layer",), guard_at_block=False, block=None, echo=lambda m: None):
    """The whole calibration of QA_FILE's questions -> the front.json content (see `calibrate_items`)."""
    items, fmt = load_qa(qa_file, fmt, limit)
    if len(items) <= held_in and target is not None:
        used = f" (--limit {limit})" if limit is not None else ""
        raise SiftError(f"{qa_file} has {len(items)} questions{used}: more than --held-in {held_in} are needed to "
                        f"hold some out; lower --held-in or use --sweep-only")
    return calibrate_items(items, out, name=str(qa_file), settings=settings, held_in=held_in, target=target,
                           model=model, device=device, dtype=dtype, max_new_tokens=max_new_tokens,
                           reuse_sweep=reuse_sweep, floor=floor, held_out_front=held_out_front,
                           held_out_all=held_out_all, guard_ca=guard_ca, guard_prompts=guard_prompts,
                           guard_by=guard_by, guard_at_block=guard_at_block, block=block, echo=echo)


def calibrate_items(items: list[QAItem], out: Path, *, name: str, settings, held_in: int, target: float | None,
                    model: str, device: str = "auto", dtype: str = "auto", max_new_tokens: int = 24,
                    reuse_sweep=False, floor=True, held_out_front=False, held_out_all=False, guard_ca=(),
                    guard_prompts=5, guard_by=("layer",), guard_at_block=False, block=None, build=sift_build,
                    batch=1, held_out_within=False, kv_bytes=None, checkpoint=lambda partial: None,
                    echo=lambda m: None):
    """The calibration of `items` (the first `held_in` held in, the rest held out) -> the front.json content.
    target None: sweep only; reuse_sweep: the points of the previous run's front.json instead of a new sweep
    (e.g. to choose again for another target); floor: also measure how often two dense computations agree
    (`_Runner.floor`) on the held-in and held-out questions; held_out_front: evaluate the paper's defaults and
    every setting of the held-in front on the held-out questions, also when no setting meets the target;
    held_out_all: the same with every swept setting, on the front or not (settings fixed beforehand, to be
    compared on held-out questions);
    guard_ca: eps values for the guarded twins of the swept settings (`guard`, measured over the first
    `guard_prompts` held-in prompts, by layer and / or by head as `guard_by` says), swept beside them; block: the
    engine's kernel block (None: 128 on CUDA, the index tile on CPU; 128 on CPU computes the blocks a GPU
    would); build: what turns a setting and a corpus folder into an index (default: the `sift-build` CLI); batch:
    questions per engine call and kv_bytes: each engine's KV pool (`_Runner`); held_out_within: also evaluate the
    paper's defaults and the swept setting the held-in questions choose at no more tiles than the defaults compute
    (`within_tiles`; the defaults must be among `settings`) on the held-out questions; checkpoint: called with the
    result so far (`complete` False) after the sweep and after each held-out setting, so a run stopped midway
    keeps what it measured."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    inside, outside = items[:held_in], items[held_in:]
    # The earlier sweep is read before the model is loaded: a missing or mismatched front.json costs nothing.
    previous = _previous_sweep(out, Path(name), len(inside), model, max_new_tokens) if reuse_sweep else None
    write_qa(inside, out / "held_in.jsonl")
    write_qa(outside, out / "held_out.jsonl")
    runner = _Runner(model, device, max_new_tokens, echo, dtype, block, batch, kv_bytes)
    if previous is not None:
        rows = previous
    else:
        rows = sweep(runner, settings, inside, out, model, echo, build)
    guards = {}
    if guard_ca and not reuse_sweep:
        twins, guards = guard(runner, rows, inside, guard_ca, guard_prompts, echo, by=guard_by, at_block=guard_at_block)
        rows += sweep(runner, twins, inside, out, model, echo, build)
    front = pareto(rows)
    result = dict(qa_file=name, model=model, device=device, dtype=runner.dtype, held_in=len(inside),
                  held_out=len(outside), max_new_tokens=max_new_tokens, target_agreement=target, points=rows,
                  front=front)
    if guards:
        result["guard"] = guards
    if floor and rows:
        result["floor"] = runner.floor(Path(rows[0]["index"]), inside)
        echo("floor (dense against dense, held in): " + _floor_line(result["floor"]))
        own = result["floor"][runner.dtype]["agreement"]
        if target is not None:
            result["target_above_floor"] = target > own
            if target > own:
                echo(f"the target {target:.0%} is above the floor: dense agrees with transformers' {runner.dtype} "
                     f"dense on {own:.0%} of the held-in questions; judge settings against the floor, or in float32")
    chosen = choose(rows, target) if target is not None else None
    evaluate_out = held_out_settings(rows, front, every=held_out_all) if held_out_front or held_out_all else []
    if held_out_within:
        best = within_tiles(rows, DEFAULT.label)
        evaluate_out = list(dict.fromkeys([DEFAULT, *([Setting(**best["setting"])] if best else []), *evaluate_out]))
    if target is not None:
        result["chosen"] = chosen
        if chosen is None:
            echo(f"no setting reaches {target:.0%} agreement on the held-in questions: no TOML written")
        else:
            setting = Setting(**chosen["setting"])
            (out / "calibrated.toml").write_text(
                f"# sift-calibrate: the sparsest setting with >= {target:.0%} whole-answer agreement with dense on "
                f"{len(inside)} held-in questions of {Path(name).name}\n" + setting.toml(model))
            evaluate_out = [setting, DEFAULT, *evaluate_out]
    checkpoint(dict(result, complete=False))
    if evaluate_out and outside:
        result["held_out_results"] = held_out(runner, evaluate_out, outside, out, model, echo, build,
                                              done=lambda so_far: checkpoint(dict(result, held_out_results=so_far,
                                                                                  complete=False)))
        if floor:
            first = next(iter(result["held_out_results"].values()))
            result["held_out_floor"] = runner.floor(Path(first["report"]).parent / "index", outside)
            echo("floor (dense against dense, held out): " + _floor_line(result["held_out_floor"]))
    pareto_front(out / "front.png", rows, front, f"{Path(name).name}: {len(inside)} held-in questions, {model}",
                 target=target, chosen=chosen, floor=result.get("floor"))
    (out / "front.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _floor_line(floor: dict) -> str:
    return ", ".join(f"transformers {d}: {f['agreement']:.0%} ({f['n']} questions)" for d, f in floor.items())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("qa_file", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Folder for front.json, front.png, calibrated.toml, the indexes and the held-out reports.")
@click.option("--held-in", type=click.IntRange(1), default=10, show_default=True,
              help="The first N questions are held in (the sweep); the rest are held out.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use the first N questions only.")
@click.option("--target-agreement", type=click.FloatRange(0, 1), default=0.95, show_default=True,
              help="Whole-answer agreement with dense the chosen setting must reach on the held-in questions.")
@click.option("--sweep-only", is_flag=True, help="Only the sweep and its front: choose nothing.")
@click.option("--reuse-sweep", is_flag=True,
              help="Take the points of DIR/front.json (same QA file, held-in, model) instead of sweeping again.")
@click.option("--setting", "settings", multiple=True,
              help='A setting to sweep, e.g. "tile=16,alpha=0.001,beta=0.01,gamma=0.1" or "tile=16,criterion=mass,'
                   'coverage=0.99" (repeatable; default: the built-in grid).')
@click.option("--model", default=None, help="The model (default: the builder's default model).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1, 512), default=24, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="The dtype the model serves in (auto: bfloat16 on CUDA, float32 on CPU).")
@click.option("--block", type=click.Choice([str(t) for t in TILES]), default=None,
              callback=lambda _c, _p, v: None if v is None else int(v),
              help="The kernel block (default: 128 on CUDA, the index tile on CPU); --block 128 on CPU computes "
                   "the blocks a GPU computes (the same tile fractions; answers up to rounding).")
@click.option("--floor/--no-floor", default=True, show_default=True,
              help="Also measure how often dense agrees with dense (transformers' attention, each dtype).")
@click.option("--held-out-front", is_flag=True,
              help="Evaluate the defaults and every setting of the held-in front on the held-out questions.")
@click.option("--held-out-all", is_flag=True,
              help="Evaluate the defaults and every swept setting, on the front or not, on the held-out questions.")
@click.option("--guard-ca", "guard_ca", multiple=True, type=click.FloatRange(0, 1, min_open=True),
              help="Also sweep each setting's guarded twin: CA pages kept whole in the layers whose document rows "
                   "lose more than this share of their attention mass on dropped CA pages (repeatable).")
@click.option("--guard-by", "guard_by", multiple=True, type=click.Choice(GUARD_BY), default=("layer",),
              show_default=True, help="What a guard keeps whole: the CA pages of losing layers, or of losing (layer, "
                                      "head) pairs (finer); repeat for both.")
@click.option("--guard-prompts", type=click.IntRange(1), default=5, show_default=True,
              help="Held-in prompts the guard measures each setting's in-context attention on.")
@click.option("--guard-at-block", is_flag=True,
              help="Count the guard's lost mass as the engine's kernel block computes the bits (a dropped page inside "
                   "a computed block is not lost) instead of at the index tile.")
def main(qa_file, out, held_in, limit, target_agreement, sweep_only, reuse_sweep, settings, model, fmt, max_new_tokens,
         device, dtype, block, floor, held_out_front, held_out_all, guard_ca, guard_by, guard_prompts, guard_at_block):
    """Sweep profile settings on held-in questions of QA_FILE, draw the Pareto front of agreement with dense
    against tiles computed, and write the sparsest setting meeting the target as a `sift-build` config."""
    from sift.model import DEFAULT_MODEL

    log = lambda msg: click.echo(msg, err=True)  # noqa: E731
    try:
        grid = [parse_setting(s) for s in settings] or list(DEFAULT_GRID)
        check_output_dir(out)
        result = calibrate(qa_file, out, settings=grid, held_in=held_in, limit=limit,
                           target=None if sweep_only else target_agreement, model=model or DEFAULT_MODEL, fmt=fmt,
                           device=device, dtype=dtype, max_new_tokens=max_new_tokens, reuse_sweep=reuse_sweep,
                           floor=floor, held_out_front=held_out_front, held_out_all=held_out_all, guard_ca=guard_ca,
                           guard_prompts=guard_prompts, guard_by=guard_by, guard_at_block=guard_at_block, block=block,
                           echo=log)
    except SiftError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_ERROR)
    for row in result["front"]:
        click.echo(f"front: {row['label']}: agreement {row['agreement']:.0%}, "
                   f"tiles computed {row['tile_fraction']:.1%}")
    if result.get("chosen"):
        click.echo(f"chosen: {result['chosen']['label']} -> {out / 'calibrated.toml'}")
    sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
