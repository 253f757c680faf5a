"""The builder's configuration: one frozen, typed config per concern, read from TOML, validated at the
boundary (unknown keys are an error), hashed, and written into the index it produced.

    model = "smollm2-135m-instruct"       # or a local transformers folder
    [profile]   tile, criterion ("threshold" | "reader"), alpha, beta, gamma, la_criterion ("threshold" |
                "mass"), la_coverage, ca_normalize (the threshold criterion's), coverage, reader (the reader
                criterion's), force_sink_page, dense_heads, ca_full_layers, ca_full_heads, prefix_text, dtype
    [corpus]    id_field, text_field, too_long ("error" | "split"), max_tokens (0: the model's context),
                follow_symlinks (read files whose symlink leads outside the corpus folder)
    [build]     batch_tokens (tokens of one forward: documents packed back to back), shard_tokens and
                shard_rows (what one shard holds at most), backend ("auto" | "torch" | "triton"), actors (0:
                sized from Ray's resources), threads (torch threads of a CPU actor; 0: from its node's cores)

[build] decides how the work is cut, never the bits: it does not enter the profile key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sift.errors import SiftError
from sift.format import TILES
from sift.model import DEFAULT_MODEL, DTYPES
from sift.reader import reader_digest

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
# build.backend: "torch" profiles with the kernel's ref twin (`profile_layer_ref`), "triton" with the kernel;
# "auto" is resolved per actor (`kernels.device.resolve_backend`).
BACKENDS = ("auto", "torch", "triton")
CRITERIA = ("threshold", "reader")  # profile.criterion


@dataclass(frozen=True)
class ProfileConfig:
    """Everything that decides the bits (SPEC sections 1-2). A change here re-profiles every document."""

    tile: int = 64
    # "threshold": SPEC section 2's thresholds (alpha, beta, gamma; la_criterion, la_coverage, ca_normalize);
    # "reader": LA and CA chosen together on [prefix, document, reader] to keep `coverage` of the attention mass
    criterion: str = "threshold"
    coverage: float = 0.997         # read by the reader criterion only
    reader: str | None = None       # the reader text (reader criterion); None: the shipped one (sift.reader)
    alpha: float = 0.001
    beta: float = 0.01
    gamma: float = 0.1
    la_criterion: str = "threshold"  # "mass": per row, the fewest LA tiles holding la_coverage of its mass
    la_coverage: float = 0.95        # read by the "mass" criterion only (sift.kernels.profile_ref)
    ca_normalize: str = "causal"
    force_sink_page: bool = True
    dense_heads: tuple[tuple[int, int], ...] = ()
    ca_full_layers: tuple[int, ...] = ()  # layers whose CA pages are all kept (every head); LA unchanged
    ca_full_heads: tuple[tuple[int, int], ...] = ()  # [layer, head] pairs whose CA pages are all kept; LA unchanged
    prefix_text: str | None = None  # None: the tokenizer's BOS token if it has one, else nothing
    dtype: str = "float32"          # the dtype the model runs in while profiling

    def __post_init__(self):
        if self.tile not in TILES:
            raise SiftError(f"profile.tile = {self.tile} is not one of {', '.join(map(str, TILES))}")
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise SiftError(f"profile.{name} = {value!r} must be a number in [0, 1]")
        if self.criterion not in CRITERIA:
            raise SiftError(f"profile.criterion = {self.criterion!r} must be one of {', '.join(CRITERIA)}")
        if isinstance(self.coverage, bool) or not isinstance(self.coverage, (int, float)) \
                or not 0.0 < self.coverage <= 1.0:
            raise SiftError(f"profile.coverage = {self.coverage!r} must be a number in (0, 1]: the share of the "
                            f"attention mass the reader criterion keeps, e.g. 0.997")
        if self.reader is not None and (not isinstance(self.reader, str) or not self.reader.strip()):
            raise SiftError(f"profile.reader = {self.reader!r} must be a non-empty text, or absent for the "
                            f"shipped reader")
        if self.criterion == "reader" and self.la_criterion != "threshold":
            raise SiftError(f"profile.la_criterion = {self.la_criterion!r} does not apply with criterion = "
                            f"\"reader\", which chooses LA and CA tiles itself: remove la_criterion")
        if self.la_criterion not in ("threshold", "mass"):
            raise SiftError(f"profile.la_criterion = {self.la_criterion!r} must be 'threshold' or 'mass'")
        if not isinstance(self.la_coverage, (int, float)) or not 0.0 < self.la_coverage <= 1.0:
            raise SiftError(f"profile.la_coverage = {self.la_coverage!r} must be a number in (0, 1]")
        if self.ca_normalize not in ("causal", "key_index"):
            raise SiftError(f"profile.ca_normalize = {self.ca_normalize!r} must be 'causal' or 'key_index'")
        if self.dtype not in DTYPES:
            raise SiftError(f"profile.dtype = {self.dtype!r} must be float32, bfloat16 or float16")
        try:
            heads = tuple((int(l), int(h)) for l, h in self.dense_heads)
        except (TypeError, ValueError):
            raise SiftError(f"profile.dense_heads = {self.dense_heads!r} must be a list of [layer, head] pairs")
        object.__setattr__(self, "dense_heads", heads)
        try:
            layers = tuple(sorted({int(layer) for layer in self.ca_full_layers}))
        except (TypeError, ValueError):
            layers = (-1,)
        if any(layer < 0 for layer in layers):
            raise SiftError(f"profile.ca_full_layers = {self.ca_full_layers!r} must be a list of layer indices >= 0")
        object.__setattr__(self, "ca_full_layers", layers)
        try:
            pairs = tuple(sorted({(int(l), int(h)) for l, h in self.ca_full_heads}))
        except (TypeError, ValueError):
            pairs = ((-1, -1),)
        if any(l < 0 or h < 0 for l, h in pairs):
            raise SiftError(f"profile.ca_full_heads = {self.ca_full_heads!r} must be a list of [layer, head] pairs "
                            f"of indices >= 0")
        object.__setattr__(self, "ca_full_heads", pairs)


@dataclass(frozen=True)
class CorpusConfig:
    id_field: str = "id"
    text_field: str = "text"
    too_long: str = "error"  # "error": an errors-table row; "split": chunks with ids "<id>#part<k>"
    max_tokens: int = 0      # 0: the model's context length minus the profiling prefix
    follow_symlinks: bool = False  # False: a symlink leading outside the corpus folder is an error row

    def __post_init__(self):
        if not isinstance(self.follow_symlinks, bool):
            raise SiftError(f"corpus.follow_symlinks = {self.follow_symlinks!r} must be true or false")
        if self.too_long not in ("error", "split"):
            raise SiftError(f"corpus.too_long = {self.too_long!r} must be 'error' or 'split'")
        if self.max_tokens < 0:
            raise SiftError(f"corpus.max_tokens = {self.max_tokens} must be >= 0 (0 means the model's context)")


DEFAULT_BATCH_TOKENS = 32768


@dataclass(frozen=True)
class RunConfig:
    """How the build cuts and runs the work. A document longer than batch_tokens is a forward (and a shard) of
    its own; a shard is what one actor call profiles and writes, and the unit of crash-resume."""

    batch_tokens: int = DEFAULT_BATCH_TOKENS  # tokens of one forward, every document's profiling prefix included
    shard_tokens: int = 4 * DEFAULT_BATCH_TOKENS  # tokens of one shard at most
    shard_rows: int = 4096  # documents of one shard at most
    backend: str = "auto"  # auto: triton on a GPU actor, torch on a CPU actor
    actors: int = 0        # 0: one per GPU, or sized from the CPUs Ray reports
    threads: int = 0       # torch threads of a CPU actor; 0: its node's cores when alone there, else its share

    def __post_init__(self):
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 0:
            raise SiftError(f"build.threads = {self.threads!r} must be an integer >= 0 (0: from the node's cores)")
        for key in ("batch_tokens", "shard_tokens", "shard_rows"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SiftError(f"build.{key} = {value!r} must be an integer >= 1")
        if self.backend not in BACKENDS:
            raise SiftError(f"build.backend = {self.backend!r} must be auto, torch or triton")
        if self.actors < 0:
            raise SiftError(f"build.actors = {self.actors} must be >= 0")


@dataclass(frozen=True)
class BuildConfig:
    model: str = DEFAULT_MODEL
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    build: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def profile_key(self, model_fingerprint: str, format_version: int, reader_ids: tuple[int, ...] = ()) -> str:
        """Hash of everything that decides the bits: equal keys mean reusable rows. Only the keys a criterion
        reads enter it: a threshold config's key holds neither la_criterion and la_coverage (unless "mass") nor
        criterion, coverage and reader, so indexes built before those keys existed stay reusable; a reader
        config's holds coverage and the reader's token ids (`reader_ids`, a digest: the text as the model's
        tokenizer cuts it), not the thresholds. An empty ca_full_layers or ca_full_heads does not enter it
        either."""
        profile = dataclasses.asdict(self.profile)
        if profile["criterion"] == "threshold":
            del profile["criterion"], profile["coverage"], profile["reader"]
        else:
            for key in ("alpha", "beta", "gamma", "ca_normalize", "reader"):
                del profile[key]
            profile["reader_sha256"] = reader_digest(list(reader_ids))
        if profile.get("la_criterion") == "threshold":
            del profile["la_criterion"], profile["la_coverage"]
        for key in ("ca_full_layers", "ca_full_heads"):
            if not profile[key]:
                del profile[key]
        payload = {"profile": profile, "model": model_fingerprint,
                   "format_version": format_version}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SiftError(f"config file {path} not found: pass --config PATH to an existing TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SiftError(f"config file {path} is not valid TOML ({e}): fix the syntax") from None


_SECTIONS = {"profile": ProfileConfig, "corpus": CorpusConfig, "build": RunConfig}


def _make(cls, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SiftError(f"unknown config key(s) {', '.join(where + k for k in unknown)}: "
                        f"allowed are {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as e:
        raise SiftError(f"bad config section [{where.rstrip('.') or 'top'}]: {e}") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> BuildConfig:
    """Read a TOML config (None: configs/default.toml, or the built-in defaults, which equal it, when the
    package is installed without the repository) and apply CLI overrides (`tile=`, `alpha=`, `beta=`, `gamma=`
    go to [profile], `model=` to the top level; None values are ignored)."""
    if path is None and not (CONFIGS_DIR / "default.toml").is_file():
        raw = {}
    else:
        path = Path(path) if path is not None else CONFIGS_DIR / "default.toml"
        raw = _read_toml(path)
    top = {k: v for k, v in raw.items() if k not in _SECTIONS}
    unknown = sorted(set(top) - {"model"})
    if unknown:
        raise SiftError(f"unknown config key(s) {', '.join(unknown)} in {path}: allowed top-level keys are "
                        f"model, [profile], [corpus], [build]")
    sections = {name: dict(raw.get(name, {})) for name in _SECTIONS}
    for key in ("tile", "alpha", "beta", "gamma"):
        if overrides.get(key) is not None:
            sections["profile"][key] = overrides[key]
    model = overrides.get("model") or top.get("model", DEFAULT_MODEL)
    parts = {name: _make(cls, sections[name], f"{name}.") for name, cls in _SECTIONS.items()}
    return BuildConfig(model=str(model), **parts)


def load_config_dict(data: dict[str, Any]) -> BuildConfig:
    """Inverse of `BuildConfig.to_dict` (how the config travels to Ray actors)."""
    parts = {name: _make(cls, dict(data.get(name, {})), f"{name}.") for name, cls in _SECTIONS.items()}
    return BuildConfig(model=str(data.get("model", DEFAULT_MODEL)), **parts)
