"""The implementation registry: `impls.toml` loaded into frozen records and checked (RULES ID1-ID4).

Standard library only, so that a generic build can resolve its layers where pydantic is absent.
A broken entry is a bug in the registry, reported as a `RegistryError` naming the entry and field.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from contract import ACTIVATIONS, MXFP4_RUN_FORMATS, RUN_FORMATS
from registry.errors import RegistryError
from registry.identity import FIELDS, ImplId

DEFAULT_PATH = Path(__file__).with_name("impls.toml")

AUTO = "AUTO"

_CAPABILITY_KEYS = (
    "expert_bias",
    "activations",
    "router_weight_on_input",
    "dynamic_eplb",
    "expert_parallel",
    "moe_tensor_parallel",
)
_CONSTRAINT_KEYS = ("hidden_multiple", "intermediate_multiple")
_TABLES = ("backends", "impl", "mxfp4_run_formats")
_IMPL_KEYS = {"id", "backend", "priority", "sms", "verified_sms", "cpu", "class", "doc", "weights", "capabilities", "constraints"}
# Where an implementation's weights are dequantized (`weights`), as the catalog, the build docstrings
# and `explain` say it. "none" is the bf16 implementations' value and theirs alone.
WEIGHTS = {
    "none": "unquantized, used as loaded",
    "at_load": "dequantized to bf16 at load",
    "per_expert_group": "kept packed, dequantized per expert group in the forward",
    "per_expert": "kept quantized, dequantized per expert when it runs",
    "in_kernel": "kept quantized, decoded in registers by the GEMM kernel",
}
_CLASS_PATH_RE = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*:[A-Z][A-Za-z0-9]*$")
_BACKEND_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Capabilities:
    expert_bias: bool
    activations: frozenset[str]
    router_weight_on_input: bool
    dynamic_eplb: bool
    expert_parallel: bool
    moe_tensor_parallel: bool


@dataclass(frozen=True)
class Constraints:
    hidden_multiple: int
    intermediate_multiple: int


@dataclass(frozen=True)
class Impl:
    """One registered implementation (RULES ID4)."""

    id: ImplId
    backend: str
    priority: int
    sms: frozenset[int]
    verified_sms: frozenset[int]   # the SMs its tests have passed on: a subset of `sms`
    cpu: bool
    class_path: str
    doc: str
    weights: str                   # a key of WEIGHTS
    capabilities: Capabilities
    constraints: Constraints

    @property
    def format(self) -> str:
        """The run format it serves: its quant segment (ID4)."""
        return self.id.quant

    @property
    def class_name(self) -> str:
        return self.class_path.split(":")[1]

    @property
    def module(self) -> str:
        return self.class_path.split(":")[0]

    def runs_on(self, sm: int) -> bool:
        return sm in self.sms

    @property
    def weights_text(self) -> str:
        return WEIGHTS[self.weights]

    def verification(self, sm: int) -> str:
        """Whether it has run on `sm`, as a report line says it (an SM it does not run on: not asked)."""
        if sm in self.verified_sms:
            return f"runs on sm_{sm}: verified (tests passed there)"
        return f"runs on sm_{sm}: unverified (never run on that SM)"


@dataclass(frozen=True)
class Backend:
    name: str
    doc: str
    fallback: bool
    never_degrades: bool


@dataclass(frozen=True)
class Registry:
    """Every implementation in global priority order, the backends, and the FN2 preference table."""

    impls: tuple[Impl, ...]
    backends: tuple[Backend, ...]
    mxfp4_run_formats: tuple[tuple[int, tuple[str, ...]], ...]
    source: str

    @functools.cached_property
    def by_id(self) -> dict[str, Impl]:
        return {str(i.id): i for i in self.impls}

    @functools.cached_property
    def token_field(self) -> dict[str, str]:
        """Every token of every id, mapped to the one field it names (ID2)."""
        table: dict[str, str] = {}
        for impl in self.impls:
            for field in FIELDS:
                table[impl.id.segment(field)] = field
        return table

    @functools.cached_property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    @property
    def literals(self) -> tuple[str, ...]:
        """The backend literals a selection may name: AUTO, then the backends."""
        return (AUTO,) + self.backend_names

    @functools.cached_property
    def fallback_backend(self) -> str:
        return next(b.name for b in self.backends if b.fallback)

    def backend(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    def impl(self, impl_id: str) -> Impl:
        return self.by_id[impl_id]

    def mxfp4_preference(self, sm: int) -> tuple[str, ...] | None:
        return dict(self.mxfp4_run_formats).get(sm)


def load_registry_text(text: str, source: str = "registry/impls.toml") -> Registry:
    """Parse and check a registry from TOML text (tests build synthetic registries this way)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_TABLES))
    if unknown:
        raise RegistryError(f"{source}: unknown tables {unknown}; a registry holds {list(_TABLES)}")
    backends = tuple(_backend(source, name, body) for name, body in sorted(data.get("backends", {}).items()))
    if sum(b.fallback for b in backends) != 1:
        raise RegistryError(f"{source}: exactly one backend must declare fallback = true")
    backend_names = {b.name for b in backends}
    impls = [_impl(source, n, body, backend_names) for n, body in enumerate(data.get("impl", []))]
    if not impls:
        raise RegistryError(f"{source}: declares no [[impl]] entries")
    impls.sort(key=lambda i: i.priority)
    _check_unique(source, impls)
    _check_tokens_disjoint(source, impls)
    table = _mxfp4_table(source, data.get("mxfp4_run_formats", {}))
    return Registry(impls=tuple(impls), backends=backends, mxfp4_run_formats=table, source=source)


@functools.lru_cache(maxsize=None)
def load_registry(path: str | None = None) -> Registry:
    """The registry in `path` (default: the project's `registry/impls.toml`), loaded once."""
    target = Path(path) if path else DEFAULT_PATH
    source = "registry/impls.toml" if path is None else str(path)
    return load_registry_text(target.read_text(encoding="utf-8"), source)


def _backend(source: str, name: str, body: dict) -> Backend:
    where = f"{source}: backend {name}"
    if not _BACKEND_RE.match(name) or name == AUTO:
        raise RegistryError(f"{where}: a backend name is an upper-case literal other than AUTO (RULES ID4)")
    unknown = set(body) - {"doc", "fallback", "never_degrades"}
    if unknown:
        raise RegistryError(f"{where}: unknown keys {sorted(unknown)}")
    doc = body.get("doc", "")
    if not isinstance(doc, str) or not doc.strip() or "\n" in doc:
        raise RegistryError(f"{where}: doc must be one non-empty line")
    for flag in ("fallback", "never_degrades"):
        _check_bool(where, flag, body.get(flag, False))
    return Backend(name, doc, body.get("fallback", False), body.get("never_degrades", False))


def _check_bool(where: str, key: str, value) -> None:
    """A flag is a TOML boolean: through bool(), `cpu = "false"` would read as True."""
    if not isinstance(value, bool):
        raise RegistryError(f"{where}: {key} must be true or false, not {value!r}")


def _impl(source: str, index: int, body: dict, backends: set[str]) -> Impl:
    where = f"{source}: impl #{index + 1} ({body.get('id', '?')})"
    missing = _IMPL_KEYS - set(body)
    unknown = set(body) - _IMPL_KEYS
    if missing or unknown:
        # Only the parts that apply (it used to read "missing keys ['cpu'], unknown keys []").
        parts = ([f"missing keys {sorted(missing)}"] if missing else []) + ([f"unknown keys {sorted(unknown)}"] if unknown else [])
        raise RegistryError(f"{where}: {', '.join(parts)}; an entry sets exactly {sorted(_IMPL_KEYS)}")
    # A value of the wrong TOML type is reported, never a TypeError from the checks below.
    for key in ("id", "backend", "class", "doc"):
        if not isinstance(body[key], str):
            raise RegistryError(f"{where}: {key} must be a string")
    try:
        impl_id = ImplId.parse(body["id"])
    except RegistryError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    if body["id"] != str(impl_id):
        raise RegistryError(f"{where}: ids are stored lowercase; write {str(impl_id)!r} (RULES ID1)")
    if body["backend"] not in backends:
        raise RegistryError(f"{where}: backend {body['backend']!r} is not declared; backends: {sorted(backends)}")
    if impl_id.quant not in RUN_FORMATS:
        raise RegistryError(f"{where}: quant {impl_id.quant!r} is not a run format; run formats: {list(RUN_FORMATS)}")
    if not isinstance(body["priority"], int) or isinstance(body["priority"], bool):
        raise RegistryError(f"{where}: priority must be an integer")
    sms = body["sms"]
    if not isinstance(sms, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sms):
        raise RegistryError(f"{where}: sms must be a list of SM numbers such as [90, 100]")
    verified = body["verified_sms"]
    if not isinstance(verified, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in verified):
        raise RegistryError(f"{where}: verified_sms must be a list of SM numbers such as [90] (the SMs its tests passed on)")
    claimed = sorted(set(verified) - set(sms))
    if claimed:
        raise RegistryError(f"{where}: verified_sms lists sm {claimed[0]}, which is not among sms {sorted(sms)}")
    weights = body["weights"]
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise RegistryError(f"{where}: weights must be one of {list(WEIGHTS)}, not {weights!r}")
    if impl_id.quant == "bf16" and weights != "none":
        raise RegistryError(f"{where}: weights must be 'none' for a bf16 implementation (it holds no quantized weights)")
    if impl_id.quant != "bf16" and weights == "none":
        raise RegistryError(f"{where}: weights 'none' is for bf16 implementations; say where its {impl_id.quant} "
                            f"weights are dequantized: one of {[w for w in WEIGHTS if w != 'none']}")
    if not _CLASS_PATH_RE.match(body["class"]):
        raise RegistryError(f"{where}: class must read 'package.module:ClassName'")
    if not isinstance(body["doc"], str) or not body["doc"].strip() or "\n" in body["doc"]:
        raise RegistryError(f"{where}: doc must be one non-empty line")
    _check_bool(where, "cpu", body["cpu"])
    caps = body["capabilities"]
    if not isinstance(caps, dict) or set(caps) != set(_CAPABILITY_KEYS):
        raise RegistryError(f"{where}: capabilities must set exactly {list(_CAPABILITY_KEYS)}")
    for key in _CAPABILITY_KEYS:
        if key != "activations":
            _check_bool(where, f"capabilities.{key}", caps[key])
    if not isinstance(caps["activations"], list):
        raise RegistryError(f"{where}: capabilities.activations must be a list of activation kinds from {list(ACTIVATIONS)}")
    bad = set(caps["activations"]) - set(ACTIVATIONS)
    if bad:
        raise RegistryError(f"{where}: unknown activation kinds {sorted(bad)}; known: {list(ACTIVATIONS)}")
    cons = body["constraints"]
    if (
        not isinstance(cons, dict)
        or set(cons) != set(_CONSTRAINT_KEYS)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in cons.values())
    ):
        raise RegistryError(f"{where}: constraints must set {list(_CONSTRAINT_KEYS)} to positive integers")
    return Impl(
        id=impl_id,
        backend=body["backend"],
        priority=body["priority"],
        sms=frozenset(sms),
        verified_sms=frozenset(verified),
        cpu=bool(body["cpu"]),
        class_path=body["class"],
        doc=body["doc"],
        weights=body["weights"],
        capabilities=Capabilities(
            expert_bias=bool(caps["expert_bias"]),
            activations=frozenset(caps["activations"]),
            router_weight_on_input=bool(caps["router_weight_on_input"]),
            dynamic_eplb=bool(caps["dynamic_eplb"]),
            expert_parallel=bool(caps["expert_parallel"]),
            moe_tensor_parallel=bool(caps["moe_tensor_parallel"]),
        ),
        constraints=Constraints(**cons),
    )


def _check_unique(source: str, impls: list[Impl]) -> None:
    seen: dict[str, Impl] = {}
    priorities: dict[int, Impl] = {}
    for impl in impls:
        if str(impl.id) in seen:
            raise RegistryError(f"{source}: duplicate implementation id {str(impl.id)!r} (RULES ID1)")
        if impl.priority in priorities:
            raise RegistryError(
                f"{source}: {impl.id} and {priorities[impl.priority].id} share priority {impl.priority}; "
                "the priority order is one global order (RULES ID4)"
            )
        seen[str(impl.id)] = impl
        priorities[impl.priority] = impl


def _check_tokens_disjoint(source: str, impls: list[Impl]) -> None:
    owner: dict[str, str] = {}
    for impl in impls:
        for field in FIELDS:
            token = impl.id.segment(field)
            if owner.setdefault(token, field) != field:
                raise RegistryError(
                    f"{source}: token {token!r} is used as both {owner[token]} and {field}; "
                    "a token names exactly one field (RULES ID2)"
                )


def _mxfp4_table(source: str, body: dict) -> tuple[tuple[int, tuple[str, ...]], ...]:
    rows = []
    for key, formats in body.items():
        if not key.isdigit():
            raise RegistryError(f"{source}: mxfp4_run_formats key {key!r} must be an SM number")
        bad = [f for f in formats if f not in MXFP4_RUN_FORMATS]
        if bad or len(set(formats)) != len(formats) or not formats:
            raise RegistryError(
                f"{source}: mxfp4_run_formats.{key} must list distinct MXFP4 run formats from {list(MXFP4_RUN_FORMATS)}"
            )
        rows.append((int(key), tuple(formats)))
    return tuple(sorted(rows))
