"""The schema engine: a dict from YAML into nested dataclasses, strictly, and back; a record
slipway wrote itself (manifest.json) is read by the same rules (`from_dict(..., record=True)`).
Written by hand, not with dacite or pydantic: the image needs no extra package, and every error
names the dotted field and the valid keys. Every string of a config reaches a file, a command line
or a terminal, so the secret policy (common/secrets.py) judges every field as it is read, by what
the field holds (metadata {"secrets": ...}, default an identifier; `EDF_TEXT`: `$$` is a literal `$`)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from common.errors import ConfigError, shown, unprintable
from common.secrets import IDENTIFIER, accepted, refusal
from common.yaml import BOOL, FLOAT, INT, MAX_INT, NULL, Plain



class OutOfRange(ConfigError):
    """An integer beyond MAX_INT, told only where the field's own check (naming its bounds) says nothing first."""

    def __init__(self, where: str, value: Any, number: int):
        super().__init__(where, f"{shown(value, where)} is out of range: use a whole number between -{MAX_INT} and "
                                f"{MAX_INT}")
        self.number = number


@functools.lru_cache(maxsize=8192)
def _refusal(value: Any, name: Any, policy: str, edf: bool, hint: Any = None):
    """`refusal`, remembered: a sweep reads the same strings in each of its thousand points."""
    return refusal(value, name=name, policy=policy, edf=edf, hint=hint)


def _secret_check(value: Any, where: str, policy: str, edf: bool, key: Any = None, hint: Any = None) -> None:
    """The secret policy on one value and the mapping key it is given under (`hint`: the flag before it,
    such as --revision); what the config file being read accepts passes (common/baseline.py)."""
    if isinstance(key, str) and (found := _refusal(key, None, policy, False)) is not None and not found.expansion \
            and not accepted(found):
        raise ConfigError(where, found.message())  # a key that is a token itself
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # `PASSWORD: 123456` from a caller that typed it as a number
    name, hint = key if isinstance(key, str) else None, hint if isinstance(hint, str) and hint.startswith("-") else None
    # `refusal` passes any other type; a typed mapping's or list's values are judged one by one as read.
    if isinstance(value, str) and (found := _refusal(value, name, policy, edf, hint)) is not None \
            and not accepted(found):
        raise ConfigError(where, found.message())


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


def _scalar(tp: Any, value: Any, where: str) -> Any:
    """A scalar for field type `tp` (str, int, float or bool) from YAML text or a Python value."""
    text = value if isinstance(value, str) else None
    if tp is str:
        if text is not None:
            return str(text)
        if isinstance(value, bool):  # a Python caller's annotation value: the EDF string "true"
            return "true" if value else "false"
        hint = ' (write "" for an empty string)' if value is None else ""
        raise ConfigError(where, f"expected a string, got {shown(value, where)}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text in BOOL:
            return BOOL[text]
        raise ConfigError(where, f"expected true or false, got {shown(value, where)}")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif text is not None and len(text) <= 40 and INT.fullmatch(text):
            number = int(text, 0) if text[:2] in ("0o", "0x") else int(text)
        if number is None:
            raise ConfigError(where, f"expected an integer, got {shown(value, where)}")
        # Every int field ends up in bash arithmetic, Slurm or torch: none takes more than this;
        # each field's own check bounds it tighter where it matters.
        if abs(number) > MAX_INT:
            raise OutOfRange(where, value, number)
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 10 ** 300:
            number = float(value)
        elif text is not None and len(text) <= 40 and (FLOAT.fullmatch(text) or INT.fullmatch(text)):
            number = float(int(text, 0)) if text[:2] in ("0o", "0x") else float(text)
        if number is None:
            raise ConfigError(where, f"expected a number, got {shown(value, where)}")
        if not math.isfinite(number):
            raise ConfigError(where, f"expected a finite number, got {shown(value, where)}")
        return number
    raise TypeError(f"unsupported config type {tp!r} at {where}")


# A record slipway wrote itself (manifest.json): what it holds was checked as it was configured,
# so the secret policy is not applied again (a listing reads ten thousand of them).
RECORD = "record"


# The one rule for control characters, where a value enters: a field of names, paths or Slurm's
# values holds none of those `one_line` escapes (a terminal would act on them, a script or a log
# hide them); a field of free text (a variable's value, a command's word) holds no line break, which
# no sink carries whole, and is escaped where it is shown or written.
FREE_TEXT = {"free_text": True}


def _control(value: Any, where: str, free: bool, policy: str) -> None:
    if isinstance(value, str) and policy != RECORD and not value.isprintable() and \
            (bad := unprintable(value, free)) is not None:
        raise ConfigError(where, f"holds a line break ({bad}), which no file or command line it goes to carries whole: "
                                 "remove it" if free else f"holds a control character ({bad}), which no name, path or "
                                 "Slurm value may hold (a terminal would act on it): remove it")


def _union(tp: Any, value: Any, where: str, policy: str, edf: bool, free: bool) -> Any:
    """`value` as the first of the Union `tp`'s types it converts to (None for null where allowed)."""
    args = get_args(tp)
    if type(None) in args and (value is None or (isinstance(value, Plain) and (value == "" or value in NULL))):
        return None  # null, or an empty or null override (`slurm.account=`): unset
    options = [arg for arg in args if arg is not type(None)]
    for arg in options:
        try:
            return _convert(arg, value, where, policy, edf, checked=True, free=free)
        except OutOfRange:
            raise
        except ConfigError:
            if len(options) == 1 and ((isinstance(value, str) and arg in (str, int, float, bool)) or dataclasses.is_dataclass(arg)):
                raise  # the one type it can be says what is wrong (a NUL byte, a number's range, a key)
    raise ConfigError(where, f"expected {_type_name(tp)}, got {shown(value, where)}")


def _convert(tp: Any, value: Any, where: str, policy: str = IDENTIFIER, edf: bool = False, key: Any = None,
             checked: bool = False, hint: Any = None, free: bool = False) -> Any:
    """`value` as type `tp`; `key`: the mapping key it is given under; `checked`: the secret policy has
    seen it (a Union's alternatives); `hint`: a list's item before; `free`: a field of free text."""
    if not checked and policy != RECORD and (isinstance(value, str) or key is not None):
        _secret_check(value, where, policy, edf, key, hint)  # first: a secret's refusal says how to pass it
    _control(value, where, free, policy)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _union(tp, value, where, policy, edf, free)
    if origin is Literal:
        for arg in get_args(tp):
            with contextlib.suppress(ConfigError):
                if _scalar(type(arg), value, where) == arg:
                    return arg
        raise ConfigError(where, f"must be one of {', '.join(repr(a) for a in get_args(tp))}, got {shown(value, where)}")
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(where, f"expected a list such as [a, b], got {shown(value, where)}")
        return [_convert(item_tp, v, f"{where}[{i}]", policy, edf, hint=value[i - 1] if i else None, free=free)
                for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(where, f"expected a mapping, got {shown(value, where)}")
        if tp is dict:  # any mapping (a record's git state)
            return value
        # Keys are strings: YAML's reader refuses any other, and JSON has none.
        return {str(k): _convert(get_args(tp)[1], v, f"{where}.{k}", policy, edf, key=k, free=free)
                for k, v in value.items()}
    if hasattr(tp, "from_config_value"):  # a class with its own text form (edf.Mount: "SRC:DST:FLAGS")
        return tp.from_config_value(value, where)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, record=policy == RECORD)
    if tp is Any:
        return value
    if policy == RECORD and tp is not str and isinstance(value, str):  # JSON's types are the record's own
        raise ConfigError(where, f"expected {'an integer' if tp is int else 'a number' if tp is float else tp.__name__}"
                                 f", got {shown(value, where)}")
    return _scalar(tp, value, where)


@functools.lru_cache(maxsize=None)
def config_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of section `cls` that a config file sets (the same for a class: read once)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and f.metadata.get("config", True)}


# typing.get_type_hints is slow, and a listing reads ten thousand records: once a class.
_hints = functools.cache(typing.get_type_hints)


def unknown_key(key: str, keys: list[str], where: str, what: str) -> ConfigError:
    """The one line for `key`, set at `where` among `keys` (those of `what`): the nearest, then all."""
    near, prefix = difflib.get_close_matches(key, keys, n=3, cutoff=0.6), where.rsplit(" ", 1)[-1]
    meant = f"did you mean {' or '.join(f'{prefix}.{n}' if prefix else n for n in near)}? " if near else ""
    return ConfigError(f"{where}.{key}" if where else key, f"unknown key; {meant}valid keys of {what} are: "
                                                           f"{', '.join(keys)}")


def from_dict(cls: type, data: Any, where: str = "", *, record: bool = False) -> Any:
    """Dataclass `cls` from `data`, unknown keys and wrong types refused. A `record` keeps the keys it
    does not know (a newer slipway's) in its `others` field, if it has one, and skips the secret policy."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(where or cls.__name__, f"expected a mapping of keys, got {shown(data)}")
    fields = config_fields(cls)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown and not record:
        raise unknown_key(str(unknown[0]), list(fields), where, where or "the config")
    kwargs, too_big = {}, []
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            try:
                kwargs[name] = field_of(cls, name, data[name], where, record=record)
            except OutOfRange as exc:
                if exc.field != path:  # inside a list or a nested section: no check of this one's bounds it
                    raise
                kwargs[name] = exc.number
                too_big.append(exc)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(path, "is required")
    if record and unknown and "others" in _hints(cls):
        kwargs["others"] = {key: data[key] for key in unknown}
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)  # a field's own bounds first: `must be at most 100, got ...`
    if too_big:
        raise too_big[0]
    return obj


def field_of(cls: type, name: str, value: Any, where: str, *, record: bool = False) -> Any:
    """Field `name` of `cls` read by its type and secret policy (a `record`'s: none); the caller checks `cls`."""
    f = config_fields(cls)[name]
    return _convert(_hints(cls)[name], value, f"{where}.{name}" if where else name,
                    RECORD if record else f.metadata.get("secrets", IDENTIFIER), bool(getattr(cls, "EDF_TEXT", False)),
                    free=f.metadata.get("free_text", False))


def part_of(cls: type, data: Any, where: str) -> dict:
    """`data` as given, each key read as `from_dict` reads it but with no defaults and no checks
    between fields: a part of a section (a cluster profile's) merged into a config later read whole."""
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a mapping of keys, got {shown(data)}")
    fields = config_fields(cls)
    for key, value in data.items():
        if key not in fields:
            raise unknown_key(str(key), list(fields), where, where.rsplit(' ', 1)[-1])
        if dataclasses.is_dataclass(_hints(cls)[key]):
            part_of(_hints(cls)[key], value, f"{where}.{key}")
        else:
            field_of(cls, key, value, where)
    return data


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


def require(cond: bool, where: str, message: Union[str, typing.Callable[[], str]]) -> None:
    """`message` may be a function that words it: a check that reads ten thousand records then
    spends nothing on the messages of the checks that pass."""
    if not cond:
        raise ConfigError(where, message() if callable(message) else message)


# The message is built only for a value that fails: quoting one masks it by the secret policy, which
# costs more than the check, and a sweep reads a thousand configs.
def positive(obj: Any, where: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or not value > 0:
            raise ConfigError(f"{where}.{name}", f"must be > 0, got {shown(value)}")


def at_most(obj: Any, where: str, **limits: float) -> None:
    """Each named field at most its limit: what Slurm, bash or the trainer can take (a typo such as
    an extra digit is refused here, not by the job hours later)."""
    for name, limit in limits.items():
        value = getattr(obj, name)
        if value is not None and not value <= limit:
            raise ConfigError(f"{where}.{name}", f"must be at most {limit:g}, got {shown(value)}")


DAY = 86400
BIG = 10 ** 9  # steps and step intervals: more than any run takes

class AutoBool:
    """A field of true, false or "auto" (the trainer decides by the device): this class only reads them."""

    @staticmethod
    def from_config_value(value: Any, where: str) -> Union[bool, str]:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value in BOOL:
            return BOOL[value]
        if value == "auto":
            return "auto"
        raise ConfigError(where, f"expected true or false, got {shown(value)} (or auto: the trainer decides "
                                 "by the device)")

