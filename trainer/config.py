"""The trainer's half of the one config tree, and the schema machinery both halves use.

This module imports neither torch nor the host side: the host (`jobs.config`)
builds the full tree from these sections plus its own (slurm, container,
launch, image), and the trainer reads the same YAML file back into the same
dataclasses inside the image. Every field is typed; unknown keys, wrong types
and impossible combinations raise `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml

# The run directory's names and exit codes live in trainer/rundir.py (the protocol the batch script,
# the trainer and the host share), re-exported here for the modules that import them from here.
from trainer.rundir import HANG_EXIT, HANGS_DIR, PREFLIGHT_EXIT, PROGRESS_FILE, REQUEUE_EXIT, STOP_FILE  # noqa: F401


class ConfigError(ValueError):
    """Bad user input: one line naming the field, the rule and the fix."""

    def __init__(self, field_path: str, message: str):
        # One line, whatever the user typed: a key or value holding a newline is shown escaped,
        # and a line never grows past a screenful, however long a value a message quotes.
        self.field = bounded(_one_line(field_path), MAX_FIELD_SHOWN)
        message = _one_line(message)
        if len(message) > MAX_MESSAGE:  # keep the start (the rule) and the end (the fix)
            message = f"{message[:MAX_MESSAGE // 2]} ... {message[-MAX_MESSAGE // 2:]}"
        super().__init__(f"{self.field}: {message}" if self.field else message)


MAX_SHOWN = 80  # characters of a value quoted in an error message
MAX_FIELD_SHOWN = 400
MAX_MESSAGE = 1000


def _one_line(text: str) -> str:
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def bounded(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters (with `...`), for quoting what the user gave in a message."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


MAX_PATH_SHOWN = 400  # a path is what the user must find: longer than other values, cut in the middle


def bounded_path(path: object) -> str:
    """A path for an error message: whole up to MAX_PATH_SHOWN characters, else its start and
    its end (the file name) around `...`."""
    text = str(path)
    if len(text) <= MAX_PATH_SHOWN:
        return text
    half = (MAX_PATH_SHOWN - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


# --------------------------------------------------------------------------
# Reading YAML: the schema decides what a scalar means, not YAML 1.1.
#
# PyYAML implements YAML 1.1, where `10:00` is the integer 600, `0123` is 83,
# `yes` is true and a second `train:` silently replaces the first. Here every
# plain scalar stays the text the user wrote (`Plain`), except YAML 1.2's null
# (`null`, `~`, nothing), and the dataclass field it lands in converts it: a
# string field keeps `0123` and `10:00` as written, an int field parses YAML
# 1.2 integers, a bool field takes true/false only. Duplicate keys are errors
# naming both lines. The same reader serves configs/*.yaml, overrides and the
# frozen runs/RUN/config.yaml the trainer reads (no extra package in the image).
# --------------------------------------------------------------------------


class Plain(str):
    """A plain (unquoted) YAML scalar or an override value, exactly as written."""


_NULL = frozenset({"null", "Null", "NULL", "~"})
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's null as the only implicit type, and no duplicate keys."""

    yaml_implicit_resolvers: dict = {}

    def construct_yaml_str(self, node: yaml.Node) -> str:
        value = self.construct_scalar(node)
        if node.style is None:  # plain: null, or text for the schema to type
            return None if value in _NULL or value == "" else Plain(value)
        return str(value)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if not isinstance(node, yaml.MappingNode):
            return super().construct_mapping(node, deep=deep)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise ConfigError(f"line {line}", f"key {_shown(key)} is not a string: keys are names such as "
                                                  "train or steps")
            if key in seen:
                raise ConfigError(f"line {line}", f"duplicate key {_shown(key)} (first at line {seen[key]}): "
                                  "YAML keeps only one of them; merge the two into one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    # A config is a few hundred short lines: these bounds refuse what no config needs (a
    # "billion laughs" of nested aliases, a document nested hundreds of levels deep) before
    # it is built, so such a file is refused at once instead of exhausting time or memory.
    def compose_document(self) -> yaml.Node:
        self._depth, self._aliases = 0, 0
        node = super().compose_document()
        _expanded_size(node, 1, {}, [0])
        return node

    def compose_node(self, parent: Optional[yaml.Node], index: Any) -> yaml.Node:
        line = self.peek_event().start_mark.line + 1
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise ConfigError(f"line {line}", f"more than {MAX_ALIASES} aliases (*name): a config needs a "
                                                  "few; write the values out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"line {line}", f"nested deeper than {MAX_DEPTH} levels: no config field takes "
                                                  "that; flatten it")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


MAX_TEXT = 1_000_000  # characters of a config file or an override
MAX_DEPTH = 32  # levels of nested mappings and lists, aliases expanded
MAX_ALIASES = 100
MAX_NODES = 100_000  # values in a document with its aliases expanded
MAX_INT = 2 ** 53 - 1  # exact in a float and in JSON, well within bash's 64-bit arithmetic


def _expanded_size(node: yaml.Node, depth: int, heights: dict[int, int], count: list[int]) -> int:
    """The height of `node` with aliases expanded (shared nodes visited once, counted each time
    they are used), refusing a document deeper than MAX_DEPTH or larger than MAX_NODES."""
    where = f"line {node.start_mark.line + 1}"
    known = heights.get(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    if known is None:
        known = 1 + max((_expanded_size(child, depth + 1, heights, count) for child in children), default=0)
        heights[id(node)] = known
    else:
        count[0] += _subtree_size(node, {})
    count[0] += 1
    if depth + known - 1 > MAX_DEPTH:
        raise ConfigError(where, f"nested deeper than {MAX_DEPTH} levels (aliases expanded): no config field takes "
                                 "that; flatten it")
    if count[0] > MAX_NODES:
        raise ConfigError(where, f"more than {MAX_NODES} values once its aliases (*name) are expanded: a config "
                                 "needs far fewer; write the values out")
    return known


def _subtree_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values below `node`, aliases expanded (memoized: a shared node is sized once)."""
    size = sizes.get(id(node))
    if size is None:
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        size = sizes[id(node)] = sum(1 + _subtree_size(c, sizes) for c in children)
    return size


_Loader.add_constructor("tag:yaml.org,2002:str", _Loader.construct_yaml_str)
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])


def read_yaml(text: str, source: str, *, lines: bool = True) -> Any:
    """`text` parsed with the rules above; `source` (a file name, or a field for an
    override: `lines=False`) names the place in errors, with the line."""
    if len(text) > MAX_TEXT:
        raise ConfigError(source, f"{len(text)} characters: larger than any config ({MAX_TEXT} at most); "
                                  "check that this is the file you meant")
    try:
        return yaml.load(text, Loader=_Loader)
    except ConfigError as exc:
        raise ConfigError(f"{source} {exc.field}" if exc.field else source, str(exc).split(": ", 1)[-1]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source} line {mark.line + 1}" if mark is not None and lines else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(where, f"not valid YAML ({' '.join(str(problem).split())}): check the quoting and "
                                 "indentation there") from None


# --------------------------------------------------------------------------
# Schema machinery: a dict from YAML into nested dataclasses, strictly.
# Written by hand (rather than dacite/pydantic) because the image must not
# need extra packages and every error must carry the dotted field path and
# the list of valid keys. Fields with metadata {"config": False} are not
# part of the config (e.g. where a model came from).
# --------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


# A variable name that looks like it holds a secret, matched case-insensitively anywhere in the
# name (HF_TOKEN, wandb_key, my_api_key, AWS_SECRET_ACCESS_KEY, DB_PASSWD, GIT_CREDENTIALS, OAUTH_X),
# except TOKENIZ... (TOKENIZERS_PARALLELISM) and AUTHOR..., which name no secret.
SECRET_WORD = re.compile(r"TOKEN(?!IZ)|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH(?!OR)|PRIVATE", re.IGNORECASE)
# NAME=value inside a value the user gave (an sbatch option `--export=ALL,HF_TOKEN=x`).
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([^,\s'\"]*)")


def secret_word(name: str) -> Optional[str]:
    """The part of `name` that makes it look like a secret's name (upper case), or None."""
    m = SECRET_WORD.search(name) if isinstance(name, str) else None
    return m.group(0).upper() if m else None


def _shown(value: Any, where: str = "") -> str:
    """A value as the user wrote it, for error messages: at most about MAX_SHOWN characters
    (a long string, a deep or shared list or a huge number is cut, never printed whole), and
    never a secret's: the value of a field whose name looks like one (`where`'s last part),
    or of a NAME=value inside it, is hidden. Every message quoting a value comes through here."""
    if where and secret_word(re.split(r"[.\[]", where)[-1] or where):
        return "<a value, hidden: the name looks like a secret's>"
    shown = bounded(_brief(value, MAX_SHOWN), 2 * MAX_SHOWN)
    return _ASSIGNMENT.sub(lambda m: f"{m[1]}=<hidden>" if secret_word(m[1]) and m[2] else m[0], shown)


def _brief(value: Any, room: int) -> str:
    """repr(value), but stopping once about `room` characters are written (each level of a
    nested value costs at least two, so the recursion ends too)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(str(value) if len(value) <= room else str(value[:max(room - 5, 1)]) + "...")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"<a {len(str(abs(value))) if abs(value) < 10 ** 4000 else 'huge'}-digit number>"
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else value
        parts, used = [], 2
        for item in items:
            if used >= room:
                parts.append("...")
                break
            if isinstance(value, dict):
                text = f"{_brief(item[0], room - used)}: {_brief(item[1], room - used)}"
            else:
                text = _brief(item, room - used)
            parts.append(text)
            used += len(text) + 2
        return ("{%s}" if isinstance(value, dict) else "[%s]") % ", ".join(parts)
    return repr(value)[:max(room, 8)]


def _scalar(tp: Any, value: Any, where: str) -> Any:
    """A scalar for field type `tp` (str, int, float or bool) from YAML text or a Python value."""
    text = value if isinstance(value, str) else None
    if tp is str:
        if text is not None:
            return str(text)
        if isinstance(value, bool):  # a Python caller's annotation value: the EDF string "true"
            return "true" if value else "false"
        hint = ' (write "" for an empty string)' if value is None else ""
        raise ConfigError(where, f"expected a string, got {_shown(value, where)}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text in _BOOL:
            return _BOOL[text]
        raise ConfigError(where, f"expected true or false, got {_shown(value, where)}")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif text is not None and len(text) <= 40 and _INT.fullmatch(text):
            number = int(text, 0) if text[:2] in ("0o", "0x") else int(text)
        if number is None:
            raise ConfigError(where, f"expected an integer, got {_shown(value, where)}")
        # Every int field ends up in bash arithmetic, Slurm or torch: none takes more than this;
        # each field's own check bounds it tighter where it matters.
        if abs(number) > MAX_INT:
            raise ConfigError(where, f"{_shown(value, where)} is out of range: use a whole number between "
                                     f"-{MAX_INT} and {MAX_INT}")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 10 ** 300:
            number = float(value)
        elif text is not None and len(text) <= 40 and (_FLOAT.fullmatch(text) or _INT.fullmatch(text)):
            number = float(int(text, 0)) if text[:2] in ("0o", "0x") else float(text)
        if number is None:
            raise ConfigError(where, f"expected a number, got {_shown(value, where)}")
        if not math.isfinite(number):
            raise ConfigError(where, f"expected a finite number, got {_shown(value, where)}")
        return number
    raise TypeError(f"unsupported config type {tp!r} at {where}")


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, Plain) and (value == "" or value in _NULL))):
            return None  # null, or an empty or null override (`slurm.account=`): unset
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError:
                pass
        raise ConfigError(where, f"expected {_type_name(tp)}, got {_shown(value, where)}")
    if origin is Literal:
        for arg in get_args(tp):
            try:
                if _scalar(type(arg), value, where) == arg:
                    return arg
            except ConfigError:
                pass
        raise ConfigError(where, f"must be one of {', '.join(repr(a) for a in get_args(tp))}, got {_shown(value, where)}")
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(where, f"expected a list such as [a, b], got {_shown(value, where)}")
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a mapping, got {_shown(value, where)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(where, f"keys must be strings, got {_shown(k, where)}")
            out[str(k)] = _convert(val_tp, v, f"{where}.{k}")
        return out
    if hasattr(tp, "from_config_value"):  # a class with its own text form (edf.Mount: "SRC:DST:FLAGS")
        return tp.from_config_value(value, where)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    return _scalar(tp, value, where)


def config_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of section `cls` that a config file sets."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and f.metadata.get("config", True)}


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where or cls.__name__, f"expected a mapping of keys, got {_shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = config_fields(cls)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = unknown[0]
        path = f"{where}.{key}" if where else str(key)
        raise ConfigError(path, f"unknown key; valid keys of {where or 'the config'} are: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(path, "is required")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)
    return obj


def to_dict(obj: Any) -> Any:
    """The plain-YAML form of a section tree (what `config.yaml` holds)."""
    if hasattr(obj, "to_config_value"):
        return obj.to_config_value()
    if dataclasses.is_dataclass(obj):
        return {name: to_dict(getattr(obj, name)) for name in config_fields(type(obj))}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, str):
        return str(obj)  # a Plain is dumped as the string it is
    return obj


def _require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ConfigError(where, message)


def _positive(obj: Any, where: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value is not None and value > 0, f"{where}.{name}", f"must be > 0, got {_shown(value)}")


def _at_most(obj: Any, where: str, **limits: float) -> None:
    """Each named field at most its limit: what Slurm, bash or the trainer can take (a typo such as
    an extra digit is refused here, not by the job hours later)."""
    for name, limit in limits.items():
        value = getattr(obj, name)
        _require(value is None or value <= limit, f"{where}.{name}",
                 f"must be at most {limit:g}, got {_shown(value)}")


DAY = 86400
BIG = 10 ** 9  # steps and step intervals: more than any run takes


# --------------------------------------------------------------------------
# Trainer sections.
# --------------------------------------------------------------------------


class AutoBool:
    """A field that is true, false or auto (decided where the trainer runs). Its values are
    the plain bool or the string "auto"; this class only reads and names them."""

    @staticmethod
    def from_config_value(value: Any, where: str) -> Union[bool, str]:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value in _BOOL:
            return _BOOL[value]
        if value == "auto":
            return "auto"
        raise ConfigError(where, f"expected true or false, got {_shown(value)} (or auto: the trainer decides "
                                 "by the device)")


# The CSCS tutorial's 109M Llama is `tiny`; the others follow common Llama shapes.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=768, intermediate_size=1536, num_layers=12, num_heads=12,
                 num_kv_heads=12, vocab_size=50257, max_position_embeddings=512,
                 tie_embeddings=True),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_layers=24, num_heads=16,
                  num_kv_heads=8, vocab_size=50257, max_position_embeddings=2048,
                  tie_embeddings=True),
    "base": dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                 num_kv_heads=4, vocab_size=32000, max_position_embeddings=2048,
                 tie_embeddings=False),
    "large": dict(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                  num_kv_heads=32, vocab_size=32000, max_position_embeddings=4096,
                  tie_embeddings=False),
}
_DIMENSIONS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "vocab_size", "max_position_embeddings")


@dataclass
class RunSection:
    """Names the run and seeds it."""

    # The run's name: its directory runs/NAME and the Slurm job name (`--run-name`); default: the
    # config file's name.
    name: str = ""
    # The Weights & Biases project the run logs to (logging.wandb).
    project: str = "slipway"
    # Seeds the model's initialisation and the order of the training windows.
    seed: int = 42


@dataclass
class ModelSection:
    """Llama decoder dimensions. `size` names a preset; any dimension given
    beside it overrides the preset; `size: custom` needs every dimension."""

    # A preset's dimensions (tiny, small, base, large: see the table below), or custom: every
    # dimension given.
    size: Literal["tiny", "small", "base", "large", "custom"] = "tiny"
    # Width of the residual stream; null: the size preset's (so for the dimensions below).
    hidden_size: Optional[int] = None
    # Width of the SwiGLU feed-forward layer; null: the preset's.
    intermediate_size: Optional[int] = None
    # Transformer blocks; null: the preset's.
    num_layers: Optional[int] = None
    # Attention heads (hidden_size must be divisible by it); null: the preset's.
    num_heads: Optional[int] = None
    # Key/value heads (grouped-query attention; num_heads must be divisible by it); null: the
    # preset's.
    num_kv_heads: Optional[int] = None
    # Token vocabulary, the tokenizer's (4096 for builtin, 50257 for gpt2); null: the preset's.
    vocab_size: Optional[int] = None
    # The longest sequence the model takes (data.seq_len at most); null: the preset's.
    max_position_embeddings: Optional[int] = None
    # Share the token embedding with the output projection; default: the preset's, false for custom.
    tie_embeddings: Optional[bool] = None
    # Base of the rotary embeddings' frequencies.
    rope_theta: float = 10000.0
    # Epsilon of RMSNorm.
    rms_norm_eps: float = 1e-5
    # Standard deviation of the weights' normal initialisation (residual output projections get
    # init_std / sqrt(2 x num_layers)).
    init_std: float = 0.025
    # flash (flash-attn: CUDA and bf16/fp16 only), sdpa (torch's scaled_dot_product_attention), or
    # auto: flash-attn where it imports on a CUDA bf16/fp16 run (required in an image built with
    # it), SDPA elsewhere.
    attention: Literal["auto", "flash", "sdpa"] = "auto"
    # A local Hugging Face Llama checkpoint to start from (full fine-tuning); null: random weights.
    init_from_hf: Optional[str] = None
    # Embedding and output rows are padded to a multiple of this (nanoGPT's 50257 -> 50304):
    # matmuls tile better and tp divides the rows. The padding does not depend on tp, so a
    # checkpoint loads into any layout; the loss only ever sees the real vocab_size logits.
    pad_vocab_multiple: int = 64

    def __post_init__(self) -> None:
        preset = MODEL_PRESETS.get(self.size, {})
        for key, value in preset.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.tie_embeddings is None:
            self.tie_embeddings = False

    def check(self, where: str) -> None:
        if self.size == "custom":
            missing = [d for d in _DIMENSIONS if getattr(self, d) is None]
            _require(not missing, f"{where}.{missing[0] if missing else ''}",
                     f"model.size is custom, so {', '.join(missing)} must be set (or pick a preset: "
                     f"{', '.join(MODEL_PRESETS)})")
        _positive(self, where, *_DIMENSIONS)
        _at_most(self, where, hidden_size=2 ** 17, intermediate_size=2 ** 19, num_layers=4096, num_heads=4096,
                 num_kv_heads=4096, vocab_size=2 ** 24, max_position_embeddings=2 ** 24, pad_vocab_multiple=2 ** 16)
        _require(self.hidden_size % self.num_heads == 0, f"{where}.num_heads",
                 f"hidden_size({self.hidden_size}) must be divisible by num_heads({self.num_heads})")
        _require(self.num_heads % self.num_kv_heads == 0, f"{where}.num_kv_heads",
                 f"num_heads({self.num_heads}) must be divisible by num_kv_heads({self.num_kv_heads})")
        _require((self.hidden_size // self.num_heads) % 2 == 0, f"{where}.num_heads",
                 f"head dimension hidden_size/num_heads = {self.hidden_size // self.num_heads} must be even "
                 "for rotary embeddings")
        _require(self.init_std > 0, f"{where}.init_std", f"must be > 0, got {self.init_std}")
        _require(self.pad_vocab_multiple >= 1, f"{where}.pad_vocab_multiple",
                 f"must be >= 1 (1 disables padding), got {self.pad_vocab_multiple}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output: vocab_size rounded up to pad_vocab_multiple."""
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple

    def num_params(self) -> int:
        """Parameter count as allocated (padded vocabulary rows included; embeddings once when tied)."""
        h, i, layers, v = self.hidden_size, self.intermediate_size, self.num_layers, self.padded_vocab_size
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_embeddings else 2)
        return layers * per_layer + embed + h


@dataclass
class ParallelSection:
    """How the ranks share the work: dp x tp x pp must equal nodes x procs_per_node."""

    # Data-parallel degree.
    dp: int = 1
    # Tensor-parallel degree: model.num_heads, num_kv_heads and intermediate_size must divide by it.
    tp: int = 1
    # Pipeline-parallel degree (stages of model.num_layers); needs untied embeddings and
    # train.grad_accum_steps >= pp.
    pp: int = 1
    # fsdp (FSDP2: parameters, gradients and optimizer state sharded over dp) or ddp (replicated;
    # zero_stage 0, no tp or pp).
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    # ZeRO stage under fsdp (parameters, gradients and optimizer state are always sharded): 3 makes
    # reshard_after_forward's auto reshard; 1 and 2 behave alike (as ZeRO-2). 0 means DDP.
    zero_stage: Literal[0, 1, 2, 3] = 1
    # Under tp, also shard the activations between blocks over the sequence (data.seq_len must
    # divide by tp).
    sequence_parallel: bool = False
    # The pipeline schedule.
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # Under tp > 1 the output projection's logits stay sharded over the (padded) vocabulary
    # and the cross-entropy is computed on the shards (torch's loss_parallel): no rank holds
    # the whole [batch, seq, vocab] logits, their fp32 copy or their gradient. No effect at tp 1.
    loss_parallel: bool = True
    # With grad_accum_steps > 1, gradients are reduced across dp ranks once, after the last
    # micro batch (FSDP2 accumulates them unsharded, DDP under no_sync): one reduce-scatter a
    # step instead of one a micro batch, for a full-size gradient buffer on each rank.
    # every_micro_batch reduces after each (less memory, more communication).
    grad_sync: Literal["last_micro_batch", "every_micro_batch"] = "last_micro_batch"
    # FSDP2: free each block's gathered parameters after its forward (all-gathered again for the
    # backward) or keep them to the backward. auto: zero_stage 3 reshards; otherwise the model
    # preset's default (trainer/layouts.py: on for large, whose bf16 weights would take 13 GB
    # a GPU), else off. true or false decide, whatever zero_stage says.
    reshard_after_forward: AutoBool = "auto"

    def check(self, where: str) -> None:
        _positive(self, where, "dp", "tp", "pp")
        _at_most(self, where, dp=2 ** 20, tp=2 ** 20, pp=2 ** 20)
        if self.dp_mode == "ddp":
            _require(self.zero_stage == 0, f"{where}.zero_stage",
                     f"dp_mode ddp replicates everything, so zero_stage must be 0 (got {self.zero_stage}); "
                     "use dp_mode fsdp for ZeRO 1-3")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class DataSection:
    """Hugging Face dataset by name or a local path (saved dataset, parquet,
    jsonl or text files); tokenizer by name or local path. `builtin` is the
    corpus and tokenizer that ship with the project (no network)."""

    # A Hugging Face dataset name, a local path, or builtin.
    dataset: str = "builtin"
    # The dataset's configuration, e.g. wikitext-103-v1.
    dataset_config: Optional[str] = None
    # The split trained on.
    split: str = "train"
    # The column holding the text.
    text_column: str = "text"
    # A Hugging Face tokenizer name, a local path, or builtin.
    tokenizer: str = "builtin"
    # Tokens per training window.
    seq_len: int = 512
    # A split to evaluate on (for local file datasets, a path); null: the last
    # validation_fraction of the training tokens.
    validation_split: Optional[str] = None
    # Share of the training tokens held out for evaluation when validation_split is null.
    validation_fraction: float = 0.01
    cache_dir: Optional[str] = None  # the token cache; default <project>/.cache/tokens
    num_proc: int = 0  # tokenizer threads; 0 = every core the process may use
    # Let global rank 0 tokenize a cache entry `slipway prepare` has not made,
    # while every other rank (and GPU) waits. Off: the job stops at once and
    # says to run `slipway prepare`. The builtin corpus is always allowed
    # (it ships in the image and takes about a second).
    tokenize_in_job: bool = False

    def check(self, where: str) -> None:
        _positive(self, where, "seq_len")
        _at_most(self, where, seq_len=2 ** 24, num_proc=4096)
        _require(0.0 <= self.validation_fraction < 0.5, f"{where}.validation_fraction",
                 f"must be in [0, 0.5), got {self.validation_fraction}")
        _require(self.num_proc >= 0, f"{where}.num_proc", f"must be >= 0 (0 = all cores), got {self.num_proc}")


@dataclass
class TrainSection:
    """The optimisation: steps, batch, AdamW and its schedule, precision, memory and speed trade-offs,
    evaluation and the hang watchdog."""

    # Optimizer steps of the whole run (a resumed run continues up to it).
    steps: int = 1500
    # Sequences per micro batch on each data-parallel rank.
    micro_batch_size: int = 64
    # Micro batches per optimizer step (pipeline parallelism splits the batch into them).
    grad_accum_steps: int = 1
    # Peak learning rate (AdamW).
    lr: float = 1e-3
    # Learning rate at the end of the decay.
    min_lr: float = 1e-5
    # Steps of linear warm-up to lr.
    warmup_steps: int = 150
    # How the learning rate goes from lr to min_lr after the warm-up.
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    # AdamW's beta1 (decay of the gradient's running mean).
    beta1: float = 0.9
    # AdamW's beta2 (decay of the squared gradient's running mean).
    beta2: float = 0.95
    # AdamW's epsilon.
    eps: float = 1e-8
    # AdamW's decoupled weight decay.
    weight_decay: float = 0.01
    # Clip the gradients' global norm to this; 0: no clipping.
    grad_clip: float = 1.0
    # Training precision: auto is bfloat16 on CUDA and float32 on the CPU.
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # torch.compile each transformer block: auto compiles on CUDA and not on the CPU (where
    # inductor's C++ build takes minutes and gains little); true or false decide.
    compile: AutoBool = "auto"
    # Recompute activations in the backward instead of keeping them: none; full (every block
    # recomputed whole: least memory, about a third more compute); selective (see selective_ac).
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # What selective recomputes: op (torchtitan's per-op policy: matmul, attention and
    # reduce-scatter outputs are kept, every second matmul and the cheap pointwise ops are
    # recomputed) or a whole number N (every N-th block is recomputed whole).
    selective_ac: str = "op"
    # float8 matmuls for the transformer blocks' linear layers (torchao, tensorwise scaling;
    # the output projection stays bf16). Needs a GPU of compute capability >= 8.9 (H100,
    # GH200) and torchao; refused elsewhere.
    float8: bool = False
    # The next step's batches are read (and, on CUDA, pinned and copied to the device without
    # blocking) while this step runs.
    prefetch: bool = True
    # Python's garbage collector runs only every gc_interval steps, on every rank at the same
    # step (torchtitan's GarbageCollection): a collection at a random moment on one rank stalls
    # every other rank at the next collective. 0 leaves the collector alone.
    gc_interval: int = 50
    # Steps between evaluations on the validation tokens; 0: none.
    eval_interval: int = 0
    # Global batches per evaluation (the same ones every time).
    eval_batches: int = 4
    # A training script run instead of the built-in trainer, with --config runs/RUN/config.yaml.
    script: Optional[str] = None
    # A step with a non-finite loss or gradient norm is skipped (no optimizer update);
    # this many in a row stop the run (exit 3): the weights are not coming back.
    max_nonfinite_steps: int = 5
    # Seconds without a completed step (its evaluation and checkpoint save included) before the
    # run counts as hung: every rank writes its stacks to hangs/ and exits HANG_EXIT (4), and
    # the batch script retries without the node that did not answer (trainer/watchdog.py).
    # The first step after a start or resume gets hang_timeout_first_step (compilation, the
    # first batches). 0 turns the watchdog off.
    hang_timeout: float = 600.0
    # hang_timeout for the first step after a start or resume.
    hang_timeout_first_step: float = 1800.0

    def check(self, where: str) -> None:
        _positive(self, where, "steps", "micro_batch_size", "grad_accum_steps", "lr", "eval_batches")
        _at_most(self, where, steps=BIG, micro_batch_size=2 ** 20, grad_accum_steps=2 ** 20, warmup_steps=BIG,
                 gc_interval=BIG, eval_interval=BIG, eval_batches=2 ** 20, max_nonfinite_steps=BIG,
                 hang_timeout=30 * DAY, hang_timeout_first_step=30 * DAY)
        _require(0 <= self.min_lr <= self.lr, f"{where}.min_lr",
                 f"must be between 0 and lr({self.lr}), got {self.min_lr}")
        _require(self.warmup_steps >= 0, f"{where}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"{where}.{name}", f"must be in [0, 1), got {value}")
        _require(self.eps > 0 and self.weight_decay >= 0 and self.grad_clip >= 0, f"{where}.eps",
                 "eps must be > 0, weight_decay and grad_clip >= 0 (grad_clip 0 disables clipping)")
        _require(self.eval_interval >= 0, f"{where}.eval_interval",
                 f"must be >= 0 (0 disables evaluation), got {self.eval_interval}")
        _require(all(math.isfinite(getattr(self, n)) for n in ("lr", "min_lr", "eps")), f"{where}.lr",
                 "lr, min_lr and eps must be finite numbers")
        _require(self.max_nonfinite_steps >= 1, f"{where}.max_nonfinite_steps",
                 f"must be >= 1 (the run stops after that many non-finite steps in a row), "
                 f"got {self.max_nonfinite_steps}")
        _require(self.selective_ac == "op" or (re.fullmatch(r"[0-9]{1,9}", self.selective_ac) is not None
                                                         and int(self.selective_ac) >= 1),
                 f"{where}.selective_ac", f"must be op (per-op recomputation) or a whole number N >= 1 (every N-th "
                 f"block recomputed whole), got {_shown(self.selective_ac)}")
        _require(self.gc_interval >= 0, f"{where}.gc_interval",
                 f"must be >= 0 (0 leaves Python's garbage collector alone), got {self.gc_interval}")
        _require(self.hang_timeout >= 0 and math.isfinite(self.hang_timeout), f"{where}.hang_timeout",
                 f"must be >= 0 seconds (0 turns the hang watchdog off), got {self.hang_timeout}")
        _require(self.hang_timeout == 0 or self.hang_timeout_first_step >= self.hang_timeout,
                 f"{where}.hang_timeout_first_step", f"the first step may take longer than the others, not less: "
                 f"must be >= hang_timeout ({self.hang_timeout:g}), got {self.hang_timeout_first_step:g}")


@dataclass
class CheckpointSection:
    """Distributed checkpoints: when they are saved, how many are kept and where."""

    # Steps between checkpoints; the last step, and a stop at the time-limit warning, save too.
    interval: int = 1500
    # Complete checkpoints kept; older ones are removed.
    keep_last: int = 2
    # Save the initial weights as a checkpoint (step 0) before the first step.
    save_initial: bool = False
    # Write checkpoints in the background: a save returns once the state is staged in CPU memory
    # (the run's last save is synchronous).
    async_save: bool = False
    # Where checkpoints go, relative to the run directory.
    dir: str = "checkpoints"

    def check(self, where: str) -> None:
        _positive(self, where, "interval", "keep_last")
        _at_most(self, where, interval=BIG, keep_last=2 ** 20)


@dataclass
class LoggingSection:
    """What the run reports: metrics lines, Weights & Biases, the torch profiler."""

    # Steps between console/metrics lines. A logged step is the one place the host waits for
    # the device (the losses of the steps between stay on it), so 1 costs throughput on a GPU.
    interval: int = 10
    # Also log to Weights & Biases (offline unless WANDB_API_KEY is set).
    wandb: bool = False
    # Record optimizer steps profiler_steps with torch.profiler: a Chrome trace per rank in
    # runs/RUN/profiler/.
    profiler: bool = False
    # [first, last]: the optimizer steps the profiler records (both included).
    profiler_steps: list[int] = field(default_factory=lambda: [5, 8])
    # Level of the trainer's log messages.
    level: Literal["debug", "info", "warning"] = "info"

    def check(self, where: str) -> None:
        _positive(self, where, "interval")
        _at_most(self, where, interval=BIG)
        _require(len(self.profiler_steps) == 2 and 0 <= self.profiler_steps[0] < self.profiler_steps[1],
                 f"{where}.profiler_steps",
                 f"must be [first, last] with first < last, got {_shown(self.profiler_steps)}")


@dataclass
class TrainerConfig:
    """What the trainer reads from `runs/RUN/config.yaml`; host sections are skipped."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def check(self, where: str) -> None:
        check_trainer_sections(self)


def check_trainer_sections(cfg: Any) -> None:
    """Rules across trainer sections; `cfg` is a TrainerConfig or the host's full tree."""
    m, p = cfg.model, cfg.parallel
    _require(m.num_heads % p.tp == 0, "parallel.tp",
             f"model.num_heads({m.num_heads}) must be divisible by parallel.tp({p.tp}): "
             f"pick tp from {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}")
    _require(m.num_kv_heads % p.tp == 0, "parallel.tp",
             f"model.num_kv_heads({m.num_kv_heads}) must be divisible by parallel.tp({p.tp})")
    _require(m.intermediate_size % p.tp == 0, "parallel.tp",
             f"model.intermediate_size({m.intermediate_size}) must be divisible by parallel.tp({p.tp})")
    _require(m.padded_vocab_size % p.tp == 0, "model.pad_vocab_multiple",
             f"the vocabulary padded to a multiple of {m.pad_vocab_multiple} ({m.padded_vocab_size} rows) must be "
             f"divisible by parallel.tp({p.tp}): set model.pad_vocab_multiple to a multiple of {p.tp}, e.g. "
             f"{math.lcm(m.pad_vocab_multiple, p.tp)}")
    _require(m.num_layers >= p.pp, "parallel.pp",
             f"model.num_layers({m.num_layers}) must be >= parallel.pp({p.pp}): each stage needs a layer")
    if p.pp > 1:
        _require(not m.tie_embeddings, "model.tie_embeddings",
                 f"tied embeddings live on the first and last pipeline stage at once; with parallel.pp({p.pp}) "
                 "set model.tie_embeddings: false or parallel.pp: 1")
        _require(cfg.train.grad_accum_steps >= p.pp, "train.grad_accum_steps",
                 f"pipeline parallelism splits the batch into grad_accum_steps micro batches; "
                 f"grad_accum_steps({cfg.train.grad_accum_steps}) must be >= parallel.pp({p.pp})")
    if p.sequence_parallel:
        _require(cfg.data.seq_len % p.tp == 0, "data.seq_len",
                 f"sequence_parallel needs data.seq_len({cfg.data.seq_len}) divisible by parallel.tp({p.tp})")
    _require(cfg.data.seq_len <= m.max_position_embeddings, "data.seq_len",
             f"data.seq_len({cfg.data.seq_len}) exceeds model.max_position_embeddings"
             f"({m.max_position_embeddings}): lower seq_len or raise max_position_embeddings")


HOST_SECTIONS = ("slurm", "container", "launch", "image", "code")



def read_text_bounded(path: Path, where: str, limit: int = MAX_TEXT) -> str:
    """The UTF-8 text of `path`, refused (without reading it all) when larger than `limit`."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(where, f"{bounded(str(path))} is larger than {limit} bytes, more than any config or "
                                 "EDF holds: check that this is the file you meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(where, f"{bounded(str(path))} is not UTF-8 text (byte {exc.start}): save it as "
                                 "UTF-8") from None


def load_trainer_config(path: str | Path) -> TrainerConfig:
    """Read the trainer's sections of a resolved config (the host ones are the host's business)."""
    path = Path(path)
    try:
        raw = read_yaml(read_text_bounded(path, str(path)), str(path))
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path} must hold a mapping of sections")
    return from_dict(TrainerConfig, {k: v for k, v in raw.items() if k not in HOST_SECTIONS})
