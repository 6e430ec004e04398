"""models.yaml -> ModelSpec: the served names a server answers to, and what each one is.

    models:
      voice-agent:                      # the served name clients put in "model"
        source: default                 # HF directory, .gguf file, or the embedded default
        architecture: llama             # optional override (models.arch name or HF class)
        quantization: auto              # auto (from the checkpoint) or the format it must have
        kv_cache_dtype: auto            # auto | fp32 | fp16 | fp8
        max_model_len: 4096
        chat_template: template.jinja   # a file, or an inline Jinja string
        tool_parser: hermes             # tool-call format: hermes | llama3_json | mistral |
        pythonic
                                        # (default: from the chat template, else hermes)
        warm_prompts:                   # system prompts prefilled at start-up (prefix cache)
          - "You are a friendly voice assistant."

Relative paths are relative to the YAML file. Every mistake (unknown key,
wrong type, missing file) is a RegistryError that names the file, the model
and the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

DEFAULT_SOURCE = "default"
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"
QUANTIZATIONS = ("auto", "none", "awq", "gptq", "int8", "fp8", "gguf", "compressed-tensors")
# auto: the model dtype, but fp16 pages on CPU where integer dots run (config.kv_cache_torch_dtype)
KV_CACHE_DTYPES = ("auto", "fp32", "float32", "fp16", "float16", "fp8", "fp8_e4m3")
_KEYS = (
    "source",
    "architecture",
    "quantization",
    "kv_cache_dtype",
    "max_model_len",
    "chat_template",
    "tool_parser",
    "warm_prompts",
    "description",
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class RegistryError(ValueError):
    pass


@dataclass
class ModelSpec:
    name: str
    source: str = DEFAULT_SOURCE  # "default", or an absolute path
    architecture: str | None = None
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    chat_template: str | None = None  # inline template text or an absolute file path
    tool_parser: str | None = None  # a tools.families.PARSERS name; None: chosen from the template
    warm_prompts: list[str] = field(default_factory=list)
    description: str = ""

    @property
    def model_arg(self) -> str | None:
        """What EngineConfig.model takes: None for the embedded default."""
        return None if self.source == DEFAULT_SOURCE else self.source

    def check_files(self) -> None:
        """Raise RegistryError if a file this spec names does not exist."""
        if self.source != DEFAULT_SOURCE and not Path(self.source).exists():
            raise RegistryError(f"model {self.name!r}: source not found: {self.source}")
        if (
            self.chat_template
            and _looks_like_path(self.chat_template)
            and not Path(self.chat_template).is_file()
        ):
            raise RegistryError(
                f"model {self.name!r}: chat_template file not found: {self.chat_template}"
            )

    def check_quantization(self) -> str:
        """The checkpoint's own quantization; raises if the spec asks for a different one."""
        if self.source == DEFAULT_SOURCE or Path(self.source).suffix == ".gguf":
            found = "gguf"
        else:
            config = Path(self.source) / "config.json"
            try:
                qc = json.loads(config.read_text()).get("quantization_config") or {}
            except (OSError, ValueError) as exc:
                raise RegistryError(f"model {self.name!r}: cannot read {config}: {exc}") from None
            found = str(qc.get("quant_method") or qc.get("format") or "none").lower()
        if self.quantization not in ("auto", found):
            raise RegistryError(
                f"model {self.name!r}: models.yaml says quantization {self.quantization!r} but "
                f"{self.source} is {found!r}"
            )
        return found

    def with_overrides(self, **changes: Any) -> ModelSpec:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _looks_like_path(value: str) -> bool:
    return "{%" not in value and "{{" not in value


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def parse_entry(name: Any, entry: Any, base: Path, where: str = "models.yaml") -> ModelSpec:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegistryError(f"{where}: bad served name {name!r} (letters, digits and ._:/@+- only)")
    ctx = f"{where}: model {name!r}"
    if entry is None:
        entry = {}
    if isinstance(entry, str):  # short form: "name: path"
        entry = {"source": entry}
    if not isinstance(entry, dict):
        raise RegistryError(f"{ctx}: expected a mapping of settings, got {type(entry).__name__}")
    unknown = sorted(set(map(str, entry)) - set(_KEYS))
    if unknown:
        raise RegistryError(f"{ctx}: unknown key {unknown[0]!r} (known keys: {', '.join(_KEYS)})")

    def typed(key: str, kind: type, default: Any = None) -> Any:
        value = entry.get(key, default)
        if value is not None and (
            not isinstance(value, kind) or isinstance(value, bool) and kind is int
        ):
            # type: ignore[call-overload]
            want = {int: "an integer", str: "a string", list: "a list"}.get(kind, str(kind))
            raise RegistryError(f"{ctx}: {key} must be {want}, got {value!r}")
        return value

    if "source" not in entry:
        raise RegistryError(
            f"{ctx}: missing key 'source' (an HF directory, a .gguf file, or 'default')"
        )
    source = typed("source", str)
    if not source:
        raise RegistryError(f"{ctx}: source is empty")
    if source != DEFAULT_SOURCE:
        source = _resolve_path(source, base)
    architecture = typed("architecture", str)
    if architecture is not None:
        from edgellm.models.arch import ARCHITECTURES

        known = set(ARCHITECTURES) | {c for a in ARCHITECTURES.values() for c in a.hf_classes}
        if architecture not in known:
            raise RegistryError(
                f"{ctx}: unknown architecture {architecture!r} (known: {sorted(ARCHITECTURES)})"
            )
    quantization = str(typed("quantization", str, "auto")).lower()
    if quantization not in QUANTIZATIONS:
        raise RegistryError(
            f"{ctx}: quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    kv = typed("kv_cache_dtype", str, "auto")
    if kv not in KV_CACHE_DTYPES:
        raise RegistryError(
            f"{ctx}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv!r}"
        )
    max_len = typed("max_model_len", int)
    if max_len is not None and max_len < 1:
        raise RegistryError(f"{ctx}: max_model_len must be a positive integer, got {max_len}")
    template = typed("chat_template", str)
    if template is not None and _looks_like_path(template):
        template = _resolve_path(template, base)
    tool_parser = typed("tool_parser", str)
    if tool_parser is not None:
        from edgellm.tools.families import check_parser_name

        try:
            check_parser_name(tool_parser)
        except ValueError as exc:
            raise RegistryError(f"{ctx}: tool_parser: {exc}") from None
    warm = typed("warm_prompts", list, [])
    if any(not isinstance(p, str) or not p.strip() for p in warm):
        raise RegistryError(f"{ctx}: warm_prompts must be a list of non-empty strings")
    return ModelSpec(
        name=name,
        source=source,
        architecture=architecture,
        quantization=quantization,
        kv_cache_dtype=kv,
        max_model_len=max_len,
        chat_template=template,
        tool_parser=tool_parser,
        warm_prompts=list(warm),
        description=str(typed("description", str, "") or ""),
    )


def load_registry(path: str | Path, check_files: bool = True) -> dict[str, ModelSpec]:
    """Read and validate a models.yaml; served name -> ModelSpec, in file order."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise RegistryError(f"model registry not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RegistryError(f"{path}: expected a mapping with a 'models' key")
    extra = sorted(set(map(str, data)) - {"models"})
    if extra:
        raise RegistryError(f"{path}: unknown top-level key {extra[0]!r} (only 'models')")
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise RegistryError(f"{path}: 'models' must be a mapping of served name -> settings")
    specs: dict[str, ModelSpec] = {}
    for name, entry in models.items():
        spec = parse_entry(name, entry, path.parent.resolve(), str(path))
        if check_files:
            try:
                spec.check_files()
            except RegistryError as exc:
                raise RegistryError(f"{path}: {exc}") from None
        specs[spec.name] = spec
    return specs


def default_spec(name: str = DEFAULT_SERVED_NAME) -> ModelSpec:
    return ModelSpec(name=name, source=DEFAULT_SOURCE)


def spec_for_path(model: str, name: str | None = None) -> ModelSpec:
    """An ad-hoc spec for --model PATH (no registry entry)."""
    p = Path(model).expanduser()
    if not p.exists():
        raise RegistryError(
            f"--model {model!r} is neither a served name in the registry nor an existing path"
        )
    return ModelSpec(name=name or (p.stem if p.is_file() else p.name), source=str(p.resolve()))
