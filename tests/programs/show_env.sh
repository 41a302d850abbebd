#!/usr/bin/env bash
# A non-Python rank program: shows that it runs as given (by bash), with its arguments intact.
printf 'SHELL_RANK rank=%s size=%s bash=%s nargs=%s\n' "$MLX_RANK" "$MLX_WORLD_SIZE" "${BASH_VERSION:+yes}" "$#"
for a in "$@"; do printf 'ARG <%s>\n' "$a"; done
