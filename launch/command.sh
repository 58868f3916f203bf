# shellcheck shell=bash disable=SC2034  # the variables set here are read by the sourcing script
# Sourced by the launch scripts: their optional first argument names the hybridrl command to launch.
#
#   hybridrl_command "$@"; shift "$COMMAND_ARGS"
#
# sets COMMAND (train: PPO/GRPO, the default; sft; dpo), RECIPE (validate-config's --recipe option for sft / dpo,
# empty for train) and COMMAND_ARGS (1 when the first argument was the command, else 0: it is a config override).
hybridrl_command() {
  COMMAND=train
  RECIPE=()
  COMMAND_ARGS=0
  case "${1:-}" in
    train) COMMAND_ARGS=1 ;;
    sft | dpo) COMMAND=$1; RECIPE=(--recipe "$1"); COMMAND_ARGS=1 ;;
  esac
}
