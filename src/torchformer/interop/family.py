"""One ``Family`` per Hugging Face ``model_type``: a field table, the key map and named rules.

Reading a config.json applies each ``Field`` (a config.json key <-> a ModelConfig path, with
transformers' default), then each ``Rule`` in order (what one key cannot say: RoPE, per-layer
windows, experts), and raises one ValueError naming every setting it cannot reproduce. Writing
runs the same table backwards. Whether a config fits a family is a round trip, not a second list
of conditions: write it, read it back, and every path that comes back different is named. A
rule's ``check`` runs first, only where the round trip cannot say why: a precondition of the
writer (RoPE for rope_parameters), or a choice between families that both reproduce the config.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..configs import AttentionConfig, BlockConfig, LatentAttention, ModelConfig, MoE, RoPE
from ..models.kinds import resolve_kinds
from .hf_config import TOKEN_FIELDS, token_fields, token_ids, unsupported
from .keymap import KeyMap

REQUIRED = object()  # no default: reading a config.json without the key raises KeyError (hf.py names it)
OMIT = object()  # a write transform's "leave the key out" (the reader's default reproduces the value)
GENERATION = ("bos_token_id", "eos_token_id", "pad_token_id")
SUBCONFIGS = {"attention": AttentionConfig, "block": BlockConfig, "moe": MoE, "mla": LatentAttention}
# What no config.json says and no logit depends on (or, for the ids, metadata the readers check
# themselves): never a reason not to fit.
UNCOMPARED = {"attention.backend", "attention.dropout", "block.dropout", "dropout", "init", "init_std", *TOKEN_FIELDS}
# Paths whose stored value may be None for "derived": written, and compared, as the value used.
RESOLVED: dict[str, Callable[[ModelConfig], Any]] = {
    "attention.n_kv_heads": lambda c: c.n_kv_heads,
    "attention.head_dim": lambda c: c.head_dim,
    "attention.out_bias": lambda c: c.attention.o_bias,
    "block.d_ff": lambda c: c.d_ff,
    "n_decoder_layers": lambda c: c.decoder_layers,
    "final_norm": lambda c: c.has_final_norm,
    "moe.d_expert": lambda c: c.moe.expert_width(c.d_ff),
    "moe.d_shared": lambda c: c.moe.shared_width(c.d_ff),
}


@dataclass(frozen=True)
class Field:
    """config.json ``hf`` <-> ModelConfig path ``ours``. ``default``: transformers' value when the
    key is absent (a function of the whole config.json where it depends on other keys); with
    ``empty`` also when it is null or 0 (transformers' ``or`` defaults). ``read`` / ``write``: a
    dict (a value outside it is refused, naming the allowed ones) or a function of (value, the
    config.json / the ModelConfig); none is identity, and a read dict inverted is the write dict."""

    hf: str
    ours: str
    default: Any = REQUIRED
    read: Mapping | Callable | None = None
    write: Mapping | Callable | None = None
    empty: bool = False

    def get(self, hf: dict[str, Any], problems: list[str]) -> Any:
        if self.hf in hf and not (self.empty and not hf[self.hf]):
            value = hf[self.hf]
        elif self.default is REQUIRED:
            raise KeyError(self.hf)
        else:
            value = self.default(hf) if callable(self.default) else self.default
        if isinstance(self.read, Mapping):
            if value not in self.read:
                problems.append(f"{self.hf}={value!r}: supported are {sorted(self.read, key=repr)}")
                return OMIT
            return self.read[value]
        return value if self.read is None else self.read(value, hf)

    def put(self, cfg: ModelConfig, problems: list[str]) -> Any:
        value = resolved(cfg, self.ours)
        write = self.write
        if write is None and isinstance(self.read, Mapping):
            write = {ours: theirs for theirs, ours in reversed(list(self.read.items()))}  # the first spelling wins
        if isinstance(write, Mapping):
            if value not in write:
                problems.append(f"{self.ours}={value!r}: config.json's {self.hf} can say {sorted(write, key=repr)}")
                return OMIT
            return write[value]
        return value if write is None else write(value, cfg)


@dataclass(frozen=True)
class Rule:
    """A family-specific rule, named for what it covers. ``read(hf, values, problems)`` sets
    ModelConfig paths in ``values``; ``write(cfg, out)`` sets config.json keys; ``check(cfg)`` lists
    what the round trip cannot name (see the module docstring)."""

    name: str
    read: Callable[[dict, dict, list], None] | None = None
    write: Callable[[ModelConfig, dict], None] | None = None
    check: Callable[[ModelConfig], list[str]] | None = None


def no_aliases(cfg: ModelConfig) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Family:
    """Everything torchformer knows of one ``model_type``. ``fixed``: ModelConfig paths every
    checkpoint of it has; ``written``: config.json keys always written so; ``only``: config.json
    keys that must have this value or none (a loader for anything else is not written);
    ``ignored``: tensor-name patterns a checkpoint may carry that follow from the config;
    ``aliases(cfg)``: tensors a checkpoint may hold as copies of another; ``pairings``: the RoPE
    pairings the key map can convert (HF stores one); ``tokens``: the ids written when set;
    ``generation``: the keys copied to generation_config.json (None: no such file)."""

    model_type: str
    architecture: str
    fields: tuple[Field, ...]
    keys: Callable[[ModelConfig, list[str] | None], KeyMap]
    rules: tuple[Rule, ...] = ()
    fixed: Mapping[str, Any] = field(default_factory=dict)
    written: Mapping[str, Any] = field(default_factory=dict)
    only: Mapping[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    aliases: Callable[[ModelConfig], dict[str, str]] = no_aliases
    pairings: tuple[str, ...] = ("half",)
    tokens: tuple[str, ...] = GENERATION
    generation: tuple[str, ...] | None = GENERATION

    def keymap(self, cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
        return self.keys(cfg, hf_names)

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        problems = [
            f"{k}={hf[k]!r}: only {v!r} is supported" for k, v in self.only.items() if hf.get(k) not in (None, v)
        ]
        values = {**self.fixed, "vocab_size": hf["vocab_size"], **token_ids(hf, hf["vocab_size"])}
        for f in self.fields:
            values[f.ours] = f.get(hf, problems)
        for r in self.rules:
            if r.read is not None:
                r.read(hf, values, problems)
        unsupported(self.model_type, problems)
        return build(values)

    def config_to_hf(self, cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return self._write(cfg, dtype, [])

    def _write(self, cfg: ModelConfig, dtype: str, problems: list[str]):
        out = {"architectures": [self.architecture], "model_type": self.model_type, "dtype": dtype}
        out.update(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, **self.written)
        out.update(token_fields(cfg, self.tokens))
        for f in self.fields:
            value = f.put(cfg, problems)
            if value is not OMIT:
                out[f.hf] = value
        for r in self.rules:
            if r.write is not None:
                r.write(cfg, out)
        generation = None if self.generation is None else {k: out[k] for k in self.generation if k in out}
        return out, generation

    def unfit(self, cfg: ModelConfig) -> list[str]:
        """Why ``cfg`` cannot be written as this model_type and read back unchanged (empty: it can)."""
        problems = [why for r in self.rules if r.check is not None for why in r.check(cfg)]
        if problems:
            return problems
        try:
            out, _ = self._write(cfg, "float32", problems)
            if problems:
                return problems
            back = self.config_from_hf(json.loads(json.dumps(out)))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return [f"as {self.model_type} it does not read back ({err})"]
        pos = cfg.positions
        if isinstance(pos, RoPE) and isinstance(back.positions, RoPE) and pos.pairing in self.pairings:
            back = back.replace(positions=dataclasses.replace(back.positions, pairing=pos.pairing))
        return differences(cfg, back, self.model_type)


def resolved(cfg: ModelConfig, path: str) -> Any:
    """The value at ``path`` (None below an absent sub-config), derived where RESOLVED says."""
    head, _, rest = path.partition(".")
    if rest and getattr(cfg, head) is None:
        return None
    if path in RESOLVED:
        return RESOLVED[path](cfg)
    return getattr(getattr(cfg, head), rest) if rest else getattr(cfg, head)


def build(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from {path: value}; sub-configs are made from their dotted paths."""
    top: dict[str, Any] = {}
    subs: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            subs.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    return ModelConfig(**top, **{name: SUBCONFIGS[name](**kw) for name, kw in subs.items()})


def view(cfg: ModelConfig) -> dict[str, Any]:
    """cfg as {path: the value the model uses}; per-layer settings as each layer's resolved kind
    (two configs naming their kinds differently are the same model)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in SUBCONFIGS and value is not None:
            out.update((f"{f.name}.{g.name}", resolved(cfg, f"{f.name}.{g.name}")) for g in dataclasses.fields(value))
        else:
            out[f.name] = resolved(cfg, f.name)
    kinds, index = resolve_kinds(cfg, cfg.n_layers)
    out["layers"] = [kinds[i] for i in index]
    for name in ("attention.sliding_window", "layer_kinds", "kinds", *UNCOMPARED):
        out.pop(name, None)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def differences(cfg: ModelConfig, back: ModelConfig, model_type: str) -> list[str]:
    ours, theirs = view(cfg), view(back)
    problems = []
    for path in [*ours, *(p for p in theirs if p not in ours)]:
        a, b = ours.get(path), theirs.get(path)
        if path == "layers" and a != b:
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            problems.append(f"layer {i} is {a[i]} (as {model_type} it reads back as {b[i]})")
        elif not _same(a, b):
            problems.append(f"{path}={a!r} (as {model_type} it reads back as {b!r})")
    return problems


def module_functions(*families: Family) -> tuple[Callable, Callable]:
    """(config_from_hf, config_to_hf) over a module's families: read by the file's model_type,
    write as the first family that holds the config."""
    by_type = {f.model_type: f for f in families}

    def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
        return by_type[hf["model_type"]].config_from_hf(hf)

    def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        family = next((f for f in families if not f.unfit(cfg)), families[0])
        return family.config_to_hf(cfg, dtype)

    return config_from_hf, config_to_hf
