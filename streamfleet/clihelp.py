"""The Typer app of every `streamfleet` command, with help that reads as prose.

Typer shows each value's Python type (``<str>``, ``<int>``, ``<bool>`` on flags and on
``--help`` itself) and required arguments in braces (``{prompt}``). Here an option's
value is shown by a name (``--redis-url URL``: its ``metavar``, else the last word of the
option's name, upper case), a flag and ``--help`` by nothing, an argument by its upper-
case name in the usage line (``PROMPT``, ``[MODEL]`` when optional).

Help strings are written as whole sentences on one line each (click wraps them to the
terminal); a command's summary is its docstring's first paragraph, also on one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption
from typer.models import CommandFunctionType

if TYPE_CHECKING:
    # typer carries its own copy of click: its commands' parameters and contexts are
    # these classes (not the click package's)
    from typer._click.core import Command as _ClickCommand, Context, Parameter
else:
    _ClickCommand = object  # (a mixin: the command class it is mixed into comes after it)

__all__ = ["App", "Command", "Group", "plain_params"]


def _placeholder(param: Parameter) -> str:
    longs = [o for o in param.opts if o.startswith("--")]
    name = (longs[0] if longs else param.opts[0]).lstrip("-")
    return name.rsplit("-", 1)[-1].upper()


def _no_type(ctx: Context) -> None:
    return None


def plain_params(params: list[Parameter]) -> None:
    """Give each parameter without a ``metavar`` one that names its value, and none to a
    flag; an argument's type is not shown."""
    for param in params:
        if getattr(param, "param_type_name", "") == "argument":
            if param.metavar is None:
                param.metavar = (param.name or "").upper()
            if hasattr(param, "display_type_rich"):
                param.display_type_rich = _no_type  # (its name column already says what it is)
            continue
        if param.metavar is None:
            param.metavar = "" if getattr(param, "is_flag", False) else _placeholder(param)


def _usage(params: list[Parameter], ctx: Context, pieces: list[str]) -> list[str]:
    """The usage line with arguments as ``NAME`` (``[NAME]`` when optional)."""
    out = []
    for param in params:
        if getattr(param, "param_type_name", "") == "argument":
            piece = param.metavar or (param.name or "").upper()
            if param.nargs != 1:
                piece += "..."
            out.append(piece if param.required else f"[{piece}]")
        else:
            out.extend(param.get_usage_pieces(ctx))
    return pieces + out


class _Plain(_ClickCommand):
    """What commands and groups both do: named values for their options (``plain_params``)
    and no value shown for ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        plain_params(self.params)

    def get_help_option(self, ctx: Context) -> TyperOption | None:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Command(_Plain, TyperCommand):
    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        return _usage(self.get_params(ctx), ctx, [self.options_metavar] if self.options_metavar else [])


class Group(_Plain, TyperGroup):
    pass


class App(typer.Typer):
    """``typer.Typer`` whose groups and commands are ``Group`` and ``Command``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cls", Group)
        kwargs.setdefault("add_completion", False)
        super().__init__(**kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Callable[[CommandFunctionType], CommandFunctionType]:
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)
