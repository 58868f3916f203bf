"""Built-in environments, registered on import: ``calculator`` (arithmetic word problems with a calculator tool)
and ``guess_number`` (find a hidden number from higher / lower replies)."""

from hybridrl.rollout.agent.envs.calculator import CalculatorEnvironment, evaluate, make_calculator_task
from hybridrl.rollout.agent.envs.guess_number import GuessNumberEnvironment, make_guess_task

__all__ = ["CalculatorEnvironment", "GuessNumberEnvironment", "evaluate", "make_calculator_task", "make_guess_task"]
