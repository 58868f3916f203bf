"""Which environment a run uses: the registry of built-in environments, user files, and the start-up checks.

Loaded like the scorers (:mod:`hybridrl.rewards.registry`): ``rollout.agent.env`` names a registered environment
("calculator", "guess_number", or one a package registered with :func:`register_environment`), or, with
``rollout.agent.path``, an :class:`~hybridrl.rollout.agent.interface.Environment` subclass in that Python file.
:func:`load_agent` checks everything that does not need the tokenizer, in one line each (:class:`AgentError`),
before any model is built (:mod:`hybridrl.trainer.preflight` calls it): the file imports, the class has the
interface, it can be constructed, its tools' schemas are valid JSON schemas, the tool parser exists.
:func:`check_chat` adds the chat template's side once the tokenizer is loaded.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

from hybridrl.rollout.agent.interface import AgentError, Environment, Tool, environment_tools
from hybridrl.rollout.agent.parsers import Parser, get_parser
from hybridrl.user_code import import_user_file

_ENVIRONMENTS: dict[str, type] = {}
_INTERFACE = ("reset", "step", "tools")


def register_environment(name: str):
    """Class decorator: register an Environment subclass under ``name`` (``rollout.agent.env``).

    Raises:
        ValueError: ``name`` is taken by another class.
    """

    def add(cls: type) -> type:
        if _ENVIRONMENTS.get(name, cls) is not cls:
            raise ValueError(f"environment name {name!r} is already registered; pick another name")
        _ENVIRONMENTS[name] = cls
        return cls

    return add


def known_environments() -> list[str]:
    """Every registered environment name (the built-in ones included)."""
    import hybridrl.rollout.agent.envs  # noqa: F401  (registers the built-ins)

    return sorted(_ENVIRONMENTS)


@dataclass
class AgentSpec:
    """A checked environment: its class, the tools it offers (schemas rendered into prompts) and the parser."""

    env_cls: type
    tools: list[Tool]
    parser: Parser
    label: str
    """How messages name the environment (``rollout.agent.env 'calculator'``, or the file and class)."""

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools]


def _import_file(path: str) -> Any:
    try:
        return import_user_file(path, path_key="rollout.agent.path")
    except (FileNotFoundError, ValueError) as err:
        raise AgentError(str(err)) from err


def _class_from_file(path: str, name: str | None) -> type:
    module = _import_file(path)
    if name is not None:
        cls = getattr(module, name, None)
        if cls is None:
            found = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
            raise AgentError(f"rollout.agent.env ({name!r}) is not defined in {path!r} (its classes: {found}); set "
                             "rollout.agent.env to your environment class")  # fmt: skip
        return cls
    own = [v for v in vars(module).values() if inspect.isclass(v) and issubclass(v, Environment)
           and v.__module__ == module.__name__]  # fmt: skip
    if len(own) != 1:
        what = f"{len(own)} ({sorted(c.__name__ for c in own)})" if own else "none"
        raise AgentError(f"rollout.agent.path ({path!r}) defines {what} Environment subclasses; define one, or name "
                         "yours in rollout.agent.env")  # fmt: skip
    return own[0]


def environment_class(env: str | None, path: str | None) -> tuple[type, str]:
    """(class, label) of the configured environment; see the module docstring.

    Raises:
        AgentError: an unknown name, a file that does not import, a missing class.
    """
    if path is not None:
        cls = _class_from_file(path, env)
        return cls, f"{cls.__name__} of rollout.agent.path {path!r}"
    known = known_environments()
    if env not in _ENVIRONMENTS:
        raise AgentError(f"rollout.agent.env ({env!r}) is not a registered environment (known: {known}); set one of "
                         "them, or rollout.agent.path to your environment's .py file")  # fmt: skip
    return _ENVIRONMENTS[env], f"rollout.agent.env {env!r}"


def check_interface(cls: Any, label: str) -> Any:
    """Construct ``cls`` once (as the loop does for every trajectory) after checking its interface; returns it.

    Raises:
        AgentError: ``cls`` is not a class, lacks ``reset`` / ``step`` / ``tools`` (an Environment subclass has
            them all), or raises when constructed.
    """
    if not inspect.isclass(cls):
        raise AgentError(f"{label} is a {type(cls).__name__}, not a class; point it at an Environment subclass")
    missing = [m for m in _INTERFACE if not callable(getattr(cls, m, None))]
    if missing:
        raise AgentError(f"{label} is not an environment: it lacks {', '.join(f'{m}()' for m in missing)}; subclass "
                         "hybridrl.rollout.agent.Environment")  # fmt: skip
    try:
        return cls()
    except Exception as err:
        raise AgentError(f"{label} raised when constructed ({type(err).__name__}: {err}); environments are built "
                         "without arguments, once per trajectory: fix its __init__") from err  # fmt: skip


def load_agent(cfg: Any) -> AgentSpec | None:
    """The checked environment of a ``rollout.agent`` section (:class:`~hybridrl.config.schema_roles.AgentConfig`);
    None when the run is single-turn. Imports the user's file (which may register a tool parser) first.

    Raises:
        AgentError: the first problem, in one line (see :func:`environment_class`, :func:`check_interface`,
            :func:`~hybridrl.rollout.agent.interface.check_tool_schema`, the parser's name).
    """
    if cfg.env is None and cfg.path is None:
        return None
    if cfg.max_turns < 1:  # also a config check; the loop is built from this spec
        raise AgentError(f"rollout.agent.max_turns ({cfg.max_turns}) must be >= 1")
    cls, label = environment_class(cfg.env, os.path.expanduser(cfg.path) if cfg.path else None)
    probe = check_interface(cls, label)
    try:
        tools = environment_tools(probe)
    except AgentError as err:
        raise AgentError(f"{label}: {err}") from None
    except Exception as err:
        raise AgentError(f"{label}: tools() raised ({type(err).__name__}: {err}); fix it") from err
    return AgentSpec(cls, tools, get_parser(cfg.tool_parser), label)


def check_chat(spec: AgentSpec | None, tokenizer: Any) -> Any:
    """The chat template renders the environment's tools and appended observations (a
    :class:`~hybridrl.rollout.agent.chat.ChatFormat`; None for single-turn runs).

    Raises:
        AgentError: tools with a template that has no tool support, or a template the loop cannot extend.
    """
    if spec is None:
        return None
    from hybridrl.rollout.agent.chat import ChatFormat

    return ChatFormat(tokenizer, spec.tool_schemas())
