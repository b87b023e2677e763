"""The run spec: everything every peer of a run must agree on (model, stages, data,
method and optimizer schedule). It is hashed; peers compare hashes on contact and
ignore peers whose hash differs. Peer-local settings (device, ports, identity, paths
of local files) are not part of it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarm_node import __version__
from swarm_node.config import default_warmup_steps, suggested_lr
from swarm_node.data.spec import DataSpec
from swarm_node.errors import ConfigError
from swarm_node.optim.inner import InnerHyper
from swarm_node.optim.methods import MethodSpec, default_method
from swarm_node.optim.outer import OuterHyper
from swarm_node.spec_tables import TOP_LEVEL, check_table
from swarm_node.wire.activations import ACTIVATION_CODECS
from swarm_node.wire.boundary import BOUNDARY_CODECS
from swarm_node.wire.outer_codec import OUTER_CODECS

# Methods the networked node implements; ddp (gradients averaged every step) is simulated only.
SWARM_METHODS = ("noloco", "diloco", "local")


@dataclass(frozen=True)
class SettingNames:
    """What the user calls the model settings where the message is read: keys of a spec
    file, or command-line flags."""
    model: str
    stages: str
    layers: str


MAX_REGISTRY_SHARDS = 4096
SPEC_NAMES = SettingNames(model="model_size", stages="num_stages", layers="layers_per_stage")
CLI_NAMES = SettingNames(model="--model", stages="--stages", layers="--layers-per-stage")


def check_model_split(model_size: str, num_stages: int, layers_per_stage: Sequence[int] | None,
                      names: SettingNames = SPEC_NAMES) -> None:
    """Refuse an unknown model size or a layer split the stages cannot be built with,
    with a message that says what to change. Reads only the size table: no model is built."""
    from swarm_node.model.config import NAMED_SIZES
    from swarm_node.model.stages import split_layers

    layers_of = {name: size[1] for name, size in NAMED_SIZES.items()}
    if model_size not in layers_of:
        known = ", ".join(f"{name} ({layers} layers)" for name, layers in layers_of.items())
        raise ConfigError(f"unknown model size {model_size!r} for {names.model}; choose one of {known}")
    layers = layers_of[model_size]
    try:
        split_layers(layers, num_stages, layers_per_stage)
    except ValueError:
        if layers_per_stage is not None:
            raise ConfigError(
                f"{names.layers} {','.join(map(str, layers_per_stage))} does not fit the {model_size} "
                f"model's {layers} layers in {num_stages} stages: give {num_stages} counts that sum to "
                f"{layers}, none negative and at least 1 for each middle stage"
            ) from None
        # The even split fails only when there are more stages than layers (and more than two).
        fixes = [f"{names.stages} {max(layers, 2)} or fewer"]
        bigger = [f"{name}: {n} layers" for name, n in layers_of.items() if n >= num_stages]
        if bigger:
            fixes.append(f"a bigger {names.model} ({', '.join(bigger)})")
        spare = layers - (num_stages - 2)  # first and last stages may hold no layers, middle ones need one
        if spare >= 0:
            explicit = [0] + [1] * (num_stages - 2) + [spare]
            fixes.append(f"{names.layers} {','.join(map(str, explicit))}")
        choices = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])} or {fixes[-1]}"
        raise ConfigError(
            f"the {model_size} model has {layers} layers, which cannot be split into {num_stages} "
            f"stages: use {choices}"
        ) from None


@dataclass(frozen=True)
class RunSpec:
    run_id: str = "local"
    model_size: str = "debug"
    num_stages: int = 2
    layers_per_stage: tuple[int, ...] | None = None
    seq_len: int = 64
    batch_size: int = 8  # sequences per micro-batch
    samples_per_step: int = 8  # a node steps its inner optimizer after this many samples' gradients
    total_steps: int = 1000  # length of the lr schedule, in inner steps
    seed: int = 0
    data: DataSpec = field(default_factory=DataSpec)
    method: MethodSpec = field(default_factory=MethodSpec)
    inner: InnerHyper = field(default_factory=InnerHyper)
    # How phi and Delta go on the wire in outer rounds (wire/outer_codec.py); every peer
    # of a run encodes and decodes the same way. near4-3: phi in 4 bits coded against the
    # receiver's own, Delta in 3, with error feedback: 0.23x the bytes of fp16 for +0.4 %
    # of loss at equal tokens (docs/ALGORITHM.md section 3.2).
    outer_codec: str = "near4-3"
    # How activations and their gradients cross stage boundaries (wire/messages.py):
    # fp16, or int8 blockwise (half the bytes; the simulator's loss at equal tokens is
    # that of fp32).
    activation_codec: str = "fp16"
    # With a coded boundary (bottleneck, subspace: model/boundary.py, wire/boundary.py),
    # the compression against fp16 it is sized for: each way, everything on the wire
    # (values, steps, token ids, frame) takes at most 2 x hidden / ratio bytes a token.
    # None for the other codecs.
    activation_ratio: float | None = None
    min_version: str = "0.1.0"
    # A closed run: only these peer ids may take part (empty: anyone may join).
    allowed_peers: tuple[str, ...] = ()
    # How many DHT keys a stage's registry records are spread over (a power of two). A
    # read returns one key's records, about 1 kB each (an RSA key and signature around
    # each): 1 suits runs of a few dozen peers a stage; a run of hundreds should take
    # about its peers per stage / 4, so each read returns a handful and every node sees
    # a sample of its stage, refreshed one shard at a time (membership/registry.py).
    registry_shards: int = 1

    def __post_init__(self) -> None:
        for key, least in (("num_stages", 1), ("seq_len", 2), ("batch_size", 1), ("samples_per_step", 1),
                           ("total_steps", 1)):
            if getattr(self, key) < least:
                raise ConfigError(f"{key} must be at least {least}, got {getattr(self, key)!r}")
        if (type(self.registry_shards) is not int or not 1 <= self.registry_shards <= MAX_REGISTRY_SHARDS
                or self.registry_shards & (self.registry_shards - 1)):
            raise ConfigError(f"registry_shards must be a power of two from 1 to {MAX_REGISTRY_SHARDS}, "
                              f"got {self.registry_shards!r}")
        if not all(isinstance(p, str) and 0 < len(p) <= 128 for p in self.allowed_peers):
            raise ConfigError("allowed_peers must list peer ids (base58 strings)")
        # Checked here, from the size table alone, so that a spec file, a published spec and
        # `swarm-node local` all refuse an impossible model before any process or daemon starts.
        check_model_split(self.model_size, self.num_stages, self.layers_per_stage, SPEC_NAMES)
        if self.outer_codec not in OUTER_CODECS:
            raise ConfigError(
                f"unknown outer_codec {self.outer_codec!r}; choose one of {', '.join(OUTER_CODECS)}"
            )
        if self.activation_codec not in (*ACTIVATION_CODECS, *BOUNDARY_CODECS):
            raise ConfigError(f"unknown activation_codec {self.activation_codec!r}; choose one of "
                              f"{', '.join((*ACTIVATION_CODECS, *BOUNDARY_CODECS))}")
        ratio = self.activation_ratio
        if self.activation_codec in BOUNDARY_CODECS:
            if type(ratio) not in (int, float) or not 1 < ratio < float("inf"):
                raise ConfigError(
                    f"activation_codec {self.activation_codec} needs activation_ratio, a number "
                    f"above 1 (32: a 32nd of fp16's bytes), got {ratio!r}"
                )
        elif ratio is not None:
            raise ConfigError(f"activation_ratio sizes a coded boundary; activation_codec "
                              f"{self.activation_codec} takes none")
        if self.method.name not in SWARM_METHODS:
            raise ConfigError(
                f"method {self.method.name!r} runs only in the simulator (swarm-node sim); a swarm "
                f"trains with {', '.join(SWARM_METHODS)}"
            )

    def model(self, vocab_size: int):
        """(the ModelConfig this run trains, with its coded boundary when it has one; the
        boundary's wire codec or None): what every node, the local run's evaluation and
        the export build (model/coded.py, as the simulator does)."""
        from swarm_node.model.coded import coded_model
        from swarm_node.model.config import model_config

        return coded_model(model_config(self.model_size, vocab_size=vocab_size, max_seq_len=self.seq_len),
                           activation_codec=self.activation_codec, activation_ratio=self.activation_ratio,
                           batch_size=self.batch_size, seq_len=self.seq_len, num_stages=self.num_stages,
                           layers_per_stage=self.layers_per_stage)

    def admits(self, peer_id: str) -> bool:
        return not self.allowed_peers or peer_id in self.allowed_peers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        """Short stable hash of the canonical JSON form (16 hex digits)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict, source: str | Path | None = None) -> RunSpec:
        """``source``: the file ``raw`` was read from, for the messages."""
        if not isinstance(raw, dict):  # a peer's published spec is JSON of any shape
            raise ConfigError(f"a run spec is a table of settings, not {type(raw).__name__}")
        raw = dict(raw)
        try:
            _check_tables(raw)
            data = DataSpec(**raw.pop("data", {}))
            method_raw = dict(raw.pop("method", {}))
            outer_raw = method_raw.pop("outer", None)
            name = method_raw.pop("name", "noloco")
            method = default_method(name, inner_steps=method_raw.pop("inner_steps", None),
                                    group_size=method_raw.pop("group_size", 2),
                                    **({k: outer_raw[k] for k in ("alpha", "beta", "gamma", "nesterov")
                                        if k in outer_raw} if outer_raw else {}))
            if method_raw:
                raise TypeError(f"unknown method keys {sorted(method_raw)}")
            inner_raw = dict(raw.pop("inner", {}))
            if "betas" in inner_raw:
                inner_raw["betas"] = tuple(inner_raw["betas"])
            if raw.get("allowed_peers") is not None:
                raw["allowed_peers"] = tuple(raw["allowed_peers"])
            if raw.get("layers_per_stage") is not None:
                raw["layers_per_stage"] = tuple(raw["layers_per_stage"])
            size = raw.get("model_size", "debug")
            total = raw.get("total_steps", 1000)
            inner_raw.setdefault("lr", suggested_lr(size))
            inner_raw.setdefault("warmup_steps", default_warmup_steps(total))
            inner_raw.setdefault("total_steps", total)
            return cls(data=data, method=method, inner=InnerHyper(**inner_raw), **raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid run spec{f' {source}' if source else ''}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> RunSpec:
        try:
            raw = tomllib.loads(_read_spec_file(path))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from None
        return cls.from_dict(raw, path)

    @classmethod
    def from_file(cls, path: str | Path) -> RunSpec:
        """A run spec from ``.toml`` or ``.json``."""
        if str(path).endswith(".json"):
            try:
                raw = json.loads(_read_spec_file(path))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from None
            return cls.from_dict(raw, path)
        return cls.from_toml(path)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def compatible_version(self, version: str = __version__) -> bool:
        return version_at_least(self.min_version, version)


def _read_spec_file(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"run spec file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the run spec {path}: {exc.strerror or exc}; give a .toml or .json "
                          "file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"the run spec {path} is not text (UTF-8): give a .toml or .json file") from None


def _check_tables(raw: dict) -> None:
    """Every key of a spec file known and of its setting's type (spec_tables.py)."""
    check_table(raw, RunSpec, TOP_LEVEL)
    check_table(raw.get("data", {}), DataSpec, "[data]")
    method = raw.get("method", {})
    check_table(method, MethodSpec, "[method]")
    if method.get("outer") is not None:
        check_table(method["outer"], OuterHyper, "[method.outer]")
    check_table(raw.get("inner", {}), InnerHyper, "[inner]")


def version_at_least(minimum: str, version: str = __version__) -> bool:
    return _version_tuple(version) >= _version_tuple(minimum)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch in "0123456789")  # not isdigit(): int() refuses "¹"
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


__all__ = ["CLI_NAMES", "SPEC_NAMES", "OuterHyper", "RunSpec", "SettingNames", "check_model_split"]
