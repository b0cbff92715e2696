"""The Settings panel, built from core.config's declarations, and its raw values turned into a GenerationConfig (the
generation events skip Gradio's preprocessing, so a value of any type arrives here and gets a one-line reason)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

import gradio as gr

from app.refusals import quote, quoted_in
from core import GenerationConfig, TriForceError
from core.config import Setting, settings, type_hints, value_types

SLIDER_SPAN = 64  # an integer setting whose range is at most this wide gets a slider, a wider one a number box
RADIO_CHOICES = 4  # named choices up to this many are radio buttons, more a dropdown
WHOLE_NUMBER_CHOICES = (2, 4, 8, 16)  # offered beside the names of a setting that also takes a whole number
AUTO = "auto"
METHODS = ("triforce", "auto")  # offered on the TriForce tab (Compare runs every method itself)


def app_settings() -> dict[str, tuple[dataclasses.Field, Setting, tuple[type, ...]]]:
    """The settings the app shows, by name, with their field, declaration and allowed value types."""
    hints = type_hints()
    return {name: (f, spec, value_types(hints[name])) for name, (f, spec) in settings().items() if spec.app}


def default(name: str) -> Any:
    """A setting's default value."""
    f = settings()[name][0]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def widget_args(name: str, value: Any = dataclasses.MISSING, note: str = "") -> tuple[type[gr.Component], dict]:
    """The widget class and arguments of one setting: label, help, range, choices and step from its declaration;
    `value` overrides the default, `note` is added to the help."""
    _, spec, kinds = app_settings()[name]
    value = default(name) if value is dataclasses.MISSING else value
    common = {"label": spec.label or name, "info": spec.help + (f" · {note}" if note else ""),
              "elem_id": f"set-{name}"}
    options = spec.choices
    if bool in kinds:
        return gr.Checkbox, {"value": bool(value), **common}
    if options is not None and spec.parse is not None:
        more = [str(n) for n in WHOLE_NUMBER_CHOICES if spec.low is None or n >= spec.low] if int in kinds else []
        return gr.Dropdown, {"choices": [*options, *more], "value": str(value), "allow_custom_value": True, **common}
    if options is not None:
        return (gr.Radio if len(options) <= RADIO_CHOICES else gr.Dropdown), {"choices": list(options), "value": value,
                                                                              **common}
    if type(None) in kinds:
        return gr.Textbox, {"value": "" if value is None else str(value), "placeholder": AUTO, **common}
    if int in kinds or float in kinds:  # a slider when bounded (an integer's range small), else a number box
        bounded = spec.low is not None and spec.high is not None
        step = spec.step or (1 if float not in kinds else (spec.high - spec.low) / 100 if bounded else 0.1)
        slider = bounded and (float in kinds or spec.high - spec.low <= SLIDER_SPAN)
        return (gr.Slider if slider else gr.Number), {"minimum": spec.low, "maximum": spec.high, "value": value,
                                                      "step": step, **common}
    return gr.Textbox, {"value": str(value), **common}


def build_panel(values: Mapping[str, Any] | None = None, notes: Mapping[str, str] | None = None,
                skip: tuple[str, ...] = ()) -> dict[str, gr.Component]:
    """Every app setting's widget but those in `skip`, in declaration order, two to a row (radio groups on their
    own); `values` and `notes` override defaults and add to the help, by setting name."""
    values, notes = values or {}, notes or {}
    specs = [(name, *widget_args(name, values.get(name, dataclasses.MISSING), notes.get(name, "")))
             for name in app_settings() if name not in skip]
    panel: dict[str, gr.Component] = {}
    for alone, group in itertools.groupby(specs, key=lambda spec: spec[1] is gr.Radio):
        group = list(group)
        for start in range(0, len(group), 1 if alone else 2):
            with gr.Row():
                for name, kind, kwargs in group[start:start + (1 if alone else 2)]:
                    panel[name] = kind(**kwargs)
    return panel


def method_widget(value: str) -> gr.Radio:
    """The TriForce tab's decoding method, `value` at first: the choices the app offers there (Compare runs every
    method itself) and the declaration's label."""
    spec = settings()["method"][1]
    return gr.Radio(list(METHODS), value=value, label=spec.label, elem_id="set-method", scale=2,
                    info="triforce: levels 1 → 2 → 3 · auto: the planner picks levels and γs as it measures")


def _number(label: str, raw: Any, whole: bool) -> int | float:
    """A number from a widget or API value (text included), whole numbers kept exact at any size; anything else,
    NaN and infinities included, raises TriForceError."""
    refusal = TriForceError(f"{label} must be {'a whole number' if whole else 'a number'}, got {quote(raw)}.")
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise refusal
    if whole and isinstance(raw, (int, str)):
        with contextlib.suppress(ValueError):
            return int(raw)
    try:
        number = float(raw)
    except ValueError:
        raise refusal from None
    if not math.isfinite(number) or (whole and not number.is_integer()):
        raise refusal
    return int(number) if whole else number


def parse(name: str, raw: Any) -> Any:
    """One setting's typed value from its widget's raw value: blanks are None where the setting allows it (auto),
    numbers may come as text; what does not fit raises TriForceError with a one-line reason."""
    _, spec, kinds = app_settings()[name]
    label = spec.label or name
    if isinstance(raw, str):
        raw = raw.strip()
    if raw is None or raw == "":
        if type(None) in kinds:
            return None
        raise TriForceError(f"{label} is empty; enter {'a value' if str in kinds else 'a number'}.")
    if spec.parse is not None and isinstance(raw, (str, int)) and not isinstance(raw, bool):
        return spec.parse(raw)
    if (int in kinds or float in kinds) and str not in kinds and bool not in kinds:
        return _number(label, raw, whole=float not in kinds)
    return raw


def build_config(method: str, values: Mapping[str, Any]) -> GenerationConfig:
    """A validated GenerationConfig from widget values by setting name (other keys are ignored, missing settings
    keep their defaults); anything invalid raises TriForceError with the fix."""
    typed = {name: parse(name, values[name]) for name in app_settings() if name in values}
    try:
        return GenerationConfig(method=method, **typed).validate()
    except TriForceError as err:  # core's reason names the value as its repr: shown quoted instead, short and inert
        raise TriForceError(quoted_in(str(err), method, *typed.values())) from None
